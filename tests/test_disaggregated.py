"""examples/disaggregated end to end on CPU: two kvd daemons, a prefill and a decode worker
running a real (tiny) transformers model, the proxy; tokens identical to single-process
greedy generation, and the failure paths (prefill gone: 504 in bounded time; decode worker
restarted: serves the next request)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples", "disaggregated")
sys.path.insert(0, EXAMPLE_DIR)

import torch  # noqa: E402
from cluster import Cluster, daemon_stats  # noqa: E402
from model import compute_threads, create_model, generate_single_process, load_model  # noqa: E402
from paged_kv import BLOCK_SIZE, NUM_BLOCKS, blocks_needed  # noqa: E402
from run import complete_all, make_prompt  # noqa: E402

KV_TIMEOUT_S = 4.0
MAX_TOKENS = 8


@dataclass
class Setup:
    cluster: Cluster
    model: Any

    def reference(self, prompt: list[int]) -> list[int]:
        return generate_single_process(self.model, prompt, MAX_TOKENS)

    def complete(self, prompts: list[list[int]],
                 concurrently: bool = False) -> list[tuple[int, dict[str, Any]]]:
        return asyncio.run(complete_all(self.cluster.proxy_url, prompts, MAX_TOKENS,
                                        concurrently))

    def assert_identical(self, prompts: list[list[int]], concurrently: bool = False) -> None:
        for prompt, (status, body) in zip(prompts, self.complete(prompts, concurrently),
                                          strict=True):
            assert status == 200, body
            assert body["tokens"] == self.reference(prompt)
            assert body["kv_bytes"] == blocks_needed(len(prompt)) * kv_bytes_per_block(self.model)

    def free_blocks(self, kind: str) -> int:
        (worker,) = self.cluster.of(kind)
        with urllib.request.urlopen(f"{worker.url}/healthz", timeout=5) as r:
            return int(json.load(r)["free_blocks"])


def kv_bytes_per_block(model: Any) -> int:
    c = model.config
    kv = 2 * c.num_hidden_layers * BLOCK_SIZE * c.num_key_value_heads * c.head_dim * 4
    return kv + BLOCK_SIZE * 8  # + the int64 meta row


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    transformers.utils.logging.disable_progress_bar()
    root = tempfile.mkdtemp(prefix="kvd-dis-", dir="/tmp")  # short: Unix socket paths
    try:
        model_dir = os.path.join(root, "model")
        create_model(model_dir)
        model = load_model(model_dir)
        with Cluster(root, model_dir, kv_timeout_s=KV_TIMEOUT_S) as cluster:
            yield Setup(cluster, model)
            codes = cluster.close()
        assert all(code == 0 for name, code in codes.items()
                   if not name.startswith(("prefill", "decode"))), codes
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_tokens_identical_to_single_process(setup: Setup) -> None:
    # the reference itself is plain greedy decoding
    prompt = make_prompt(12, seed=7)
    with compute_threads():
        expected = setup.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                        do_sample=False)[0, len(prompt):].tolist()
    assert setup.reference(prompt) == expected

    one_block, three_blocks = make_prompt(9, seed=1), make_prompt(40, seed=2)
    assert blocks_needed(len(three_blocks)) == 3
    setup.assert_identical([one_block, three_blocks])
    setup.assert_identical([make_prompt(17, seed=3), make_prompt(33, seed=4)],
                           concurrently=True)
    assert setup.free_blocks("prefill") == setup.free_blocks("decode") == NUM_BLOCKS
    received = daemon_stats(setup.cluster.daemons[1])  # every KV was taken by its get
    assert received["transfers"]["received"]["done"] == 4
    assert received["keys"] == 0 and received["pool"]["used_bytes"] == 0


def test_restarted_decode_worker_serves_next_requests(setup: Setup) -> None:
    (decode,) = setup.cluster.of("decode")
    setup.cluster.restart_worker(decode)  # SIGKILL, start again: registers its blocks anew
    setup.assert_identical([make_prompt(21, seed=5)])
    setup.assert_identical([make_prompt(5, seed=6), make_prompt(50, seed=8)], concurrently=True)


def test_prefill_gone_gives_504_with_reason_in_bounded_time(setup: Setup) -> None:
    (prefill,) = setup.cluster.of("prefill")
    setup.cluster.kill_worker(prefill)
    started = time.monotonic()
    [(status, body)] = setup.complete([make_prompt(30, seed=9)])
    elapsed = time.monotonic() - started
    assert status == 504, body
    assert f"arrived within {KV_TIMEOUT_S:g}s" in body["error"]
    assert f"prefill {prefill.url} failed" in body["error"]
    assert KV_TIMEOUT_S <= elapsed < KV_TIMEOUT_S + 3
    assert setup.free_blocks("decode") == NUM_BLOCKS  # the failed request gave its blocks back

    setup.cluster.restart_worker(prefill)  # and a prefill worker that comes back serves again
    setup.assert_identical([make_prompt(19, seed=10)])
