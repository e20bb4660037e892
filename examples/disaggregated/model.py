"""The model: a small Llama with fixed random weights, and the greedy prefill/decode steps.

Every process uses the same two steps, so the disaggregated path (prefill in one process,
decode in another, the KV cache moved by kvd in between) and the single-process reference
(both steps in one process, the cache handed over in memory) run exactly the same code.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

SEED = 0
# Every process computes with one intra-op thread: the same summation order everywhere, so
# the reference and the workers can be compared token for token (and two workers on a
# small machine do not fight over cores).
COMPUTE_THREADS = 1
# transformers 5.24 names the cache argument and output field `cache`; earlier 5.x releases
# name them `past_key_values` (still accepted by 5.24, with a deprecation warning).
CACHE_ARG = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
             else "past_key_values")


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=512)


def create_model(model_dir: str) -> None:
    """Initialise the weights from a fixed seed and save them to ``model_dir``."""
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(model_config()).to(torch.float32)
    model.save_pretrained(model_dir)


def load_model(model_dir: str, device: str = "cpu") -> Any:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


@contextlib.contextmanager
def compute_threads(n: int = COMPUTE_THREADS) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_lengths(model: Any, prompt_len: int, max_tokens: int) -> str | None:
    """Why the model cannot serve a request of these lengths, or None."""
    limit = model.config.max_position_embeddings
    if prompt_len < 1 or max_tokens < 1:
        return "the prompt and max_tokens must each be at least 1"
    if prompt_len + max_tokens > limit:
        return f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds {limit} positions"
    return None


def check_tokens(model: Any, prompt_ids: Sequence[int]) -> str | None:
    """Why these prompt tokens are not valid input, or None."""
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    return f"token ids out of range [0, {vocab}): {bad[:5]}" if bad else None


@torch.inference_mode()
def prefill(model: Any, prompt_ids: Sequence[int]) -> tuple[int, DynamicCache]:
    """Run the prompt; return the first generated token (greedy) and the KV cache, whose
    layer i holds ``keys``/``values`` of shape [1, kv_heads, len(prompt_ids), head_dim]."""
    device = model.device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                **{CACHE_ARG: DynamicCache(config=model.config)})
    return int(out.logits[0, -1].argmax()), out[CACHE_ARG]


def cache_from_kv(model: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache holding the given per-layer K/V ([1, kv_heads, tokens, head_dim])."""
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(kv):
        cache.update(k.to(model.device), v.to(model.device), layer)
    return cache


@torch.inference_mode()
def decode(model: Any, cache: DynamicCache, first_token: int, prompt_len: int,
           max_tokens: int) -> list[int]:
    """Greedy decoding from a cache of ``prompt_len`` tokens: ``first_token`` and then
    ``max_tokens - 1`` more, one forward step each."""
    device = model.device
    tokens = [first_token]
    for step in range(max_tokens - 1):
        position = prompt_len + step
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                    position_ids=torch.tensor([[position]], device=device),
                    use_cache=True, **{CACHE_ARG: cache})
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def generate_single_process(model: Any, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The reference: the same prefill and decode steps in one process, no kvd."""
    with compute_threads():
        first, cache = prefill(model, prompt_ids)
        return decode(model, cache, first, len(prompt_ids), max_tokens)
