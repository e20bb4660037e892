"""KvdConnector inside vLLM's own machinery, without a model.

Scheduler side: the real ``vllm.v1.core.sched.scheduler.Scheduler`` built from the config in
``tests/fixtures/tiny_llama`` (no weights), driven step by step with hand-made
``ModelRunnerOutput``s: what it asks the worker to send and load, when blocks are freed,
and what vLLM does with a failed load under each ``kv_load_failure_policy``.

Worker side: the worker connector as vLLM builds it (``ensure_kv_transfer_initialized`` /
the connector factory), CPU KV tensors as vLLM lays them out, blocks moved between a
producer and a consumer through two `kvd serve` daemons, bytes compared.

Runs only where vLLM imports (``.ci/run`` builds a separate virtualenv with
``.ci/vllm-venv``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (see .ci/vllm-venv)")

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvd import KvdClient
from kvd.errors import BadRequest
from kvd.integrations.kv_mover import (
    DiscardOrder,
    LoadOrder,
    ReleaseOrder,
    RenewOrder,
    SendOrder,
)
from kvd.integrations.vllm import KvdConnector, KvdConnectorMetadata
from kvd.integrations.vllm_compat import Compat
from tests.conftest import ProcessDaemon, start_daemons
from tests.gpu_nodes import free_port

MODEL = os.path.join(os.path.dirname(__file__), "fixtures", "tiny_llama")
BLOCK, NUM_BLOCKS, LAYERS = 16, 64, ["model.layers.0.self_attn.attn",
                                     "model.layers.1.self_attn.attn"]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_hash = get_hash_fn_by_name("sha256")
init_none_hash(_hash)


def vllm_config(role: str, extra: dict[str, Any], policy: str = "recompute",
                num_blocks: int = NUM_BLOCKS, max_batched: int = 256) -> VllmConfig:
    model = ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=512, seed=0)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched,
                                         max_model_len=512, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
            kv_role=role, kv_load_failure_policy=policy, kv_connector_extra_config=extra))
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


class Sched:
    """A real vLLM scheduler with KvdConnector, and the engine's side played by hand."""

    def __init__(self, role: str, extra: dict[str, Any], policy: str = "recompute",
                 num_blocks: int = NUM_BLOCKS, max_batched: int = 256) -> None:
        self.config = vllm_config(role, extra, policy, num_blocks, max_batched)
        self.s = Scheduler(vllm_config=self.config, kv_cache_config=kv_cache_config(num_blocks),
                           structured_output_manager=StructuredOutputManager(self.config),
                           block_size=BLOCK, log_stats=True)
        self.finished: dict[str, Any] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 1,
            params: dict[str, Any] | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        req = Request(rid, prompt, sp, None, block_hasher=get_request_block_hasher(BLOCK, _hash))
        self.s.add_request(req)
        return req

    def step(self, kv: KVConnectorOutput | None = None, worker: Any = None,
             ) -> tuple[Any, KvdConnectorMetadata]:
        """One schedule() and its output: each scheduled request whose prompt is now
        computed samples token 7 (a prefill chunk samples nothing). With a ``worker``
        connector, it runs the step's metadata and its output is this step's ``kv``."""
        so = self.s.schedule()
        if worker is not None:
            kv = worker_output(worker, so.kv_connector_metadata)
        ids = list(so.num_scheduled_tokens)
        reqs = [self.s.requests[r] for r in ids]
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] if q.num_computed_tokens >=
                                                   q.num_prompt_tokens else [] for q in reqs],
                                kv_connector_output=kv)
        for outputs in self.s.update_from_output(so, out).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        meta = so.kv_connector_metadata
        assert isinstance(meta, KvdConnectorMetadata)
        return so, meta

    def free_blocks(self) -> int:
        return int(self.s.kv_cache_manager.block_pool.get_num_free_blocks())


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessDaemon]:
    d = ProcessDaemon(str(tmp_path_factory.mktemp("kvd"))).wait_ready()
    yield d
    assert d.stop() == 0, d.log()


def remote(key: str, tokens: int, **over: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "kvd_key": key, "kvd_source": "10.0.0.1:7700",
            "kvd_flow": "pull", "kvd_num_tokens": tokens,
            "kvd_num_blocks": -(-tokens // BLOCK), "kvd_block_size": BLOCK, **over}


# ---------------------------------------------------------------- scheduler: prefill side


def test_producer_keeps_blocks_until_sent_and_hands_off_params(daemon: ProcessDaemon) -> None:
    p = Sched("kv_producer", {"kvd_socket": daemon.socket_path, "lease_s": 12})
    address = daemon.peer_address()
    free = p.free_blocks()
    p.add("a", list(range(1, 41)), params={"do_remote_decode": True})  # 40 tokens: 3 blocks
    so, meta = p.step()
    assert so.num_scheduled_tokens == {"a": 40} and not meta.sends
    params = p.finished["a"].kv_transfer_params
    assert params["do_remote_prefill"] and params["kvd_source"] == address
    assert (params["kvd_num_tokens"], params["kvd_num_blocks"], params["kvd_block_size"]) == (
        40, 3, BLOCK)
    assert p.free_blocks() == free - 3  # delay_free: the blocks wait for the worker
    _, meta = p.step()
    assert meta.sends == [SendOrder("a", params["kvd_key"], meta.sends[0].block_ids, 12.0)]
    assert len(meta.sends[0].block_ids) == 3
    _, meta = p.step(KVConnectorOutput(finished_sending={"a"}))
    assert p.free_blocks() == free and not meta.sends

    # Aborted, or never meant for decode: nothing sent, blocks freed at once.
    p.add("b", list(range(100, 140)), max_tokens=4, params={"do_remote_decode": True})
    p.step()
    p.s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    p.add("c", list(range(200, 240)))
    _, meta = p.step()
    assert p.finished["c"].kv_transfer_params is None and not meta.sends
    assert p.free_blocks() == free


def test_producer_push_flow_needs_the_decode_daemon(daemon: ProcessDaemon) -> None:
    p = Sched("kv_producer", {"kvd_socket": daemon.socket_path, "flow": "push"})
    p.add("a", list(range(1, 41)), params={"do_remote_decode": True,
                                           "kvd_push_to": "10.0.0.2:7700"})
    p.add("b", list(range(50, 90)), params={"do_remote_decode": True})  # proxy forgot it
    p.add("c", list(range(100, 140)), params={"do_remote_decode": True, "kvd_key": "prx/c",
                                              "kvd_push_to": "10.0.0.2:7700"})
    p.step()
    assert p.finished["a"].kv_transfer_params["kvd_flow"] == "push"
    assert p.finished["b"].kv_transfer_params is None  # decode will recompute
    assert p.finished["c"].kv_transfer_params["kvd_key"] == "prx/c"  # decode waits on it
    _, meta = p.step()
    assert [(s.req_id, s.push_to) for s in meta.sends] == [("a", "10.0.0.2:7700"),
                                                           ("c", "10.0.0.2:7700")]
    assert meta.sends[1].key == "prx/c"


def test_push_sends_parts_while_a_chunked_prefill_runs(daemon: ProcessDaemon) -> None:
    p = Sched("kv_producer", {"kvd_socket": daemon.socket_path, "flow": "push",
                              "push_part_blocks": 4}, max_batched=64)
    p.add("long", list(range(1, 151)), params={"do_remote_decode": True, "kvd_key": "L",
                                               "kvd_push_to": "10.0.0.2:7700"})
    sends = []
    for chunk in (64, 64, 22):  # 150 tokens in chunks of 64: 10 blocks, parts 4 + 4 + 2
        so, meta = p.step()
        assert so.num_scheduled_tokens == {"long": chunk}
        sends += meta.sends
    # Parts 0 and 1 went while prefill still ran (their blocks were written by then),
    # staged, not final; the last one goes when the request finishes.
    assert [(s.key, s.final, s.stage) for s in sends] == [("L#p0", False, True),
                                                         ("L#p1", False, True)]
    assert p.finished["long"].kv_transfer_params["kvd_push_parts"] == 4
    _, meta = p.step()
    assert [(s.key, s.final, len(s.block_ids)) for s in meta.sends] == [("L#p2", True, 2)]
    ids = [b for s in [*sends, *meta.sends] for b in s.block_ids]
    assert len(ids) == len(set(ids)) == 10

    # Decode, told before prefill ran (no counts): one load per part, all or nothing.
    d = Sched("kv_consumer", {"push_part_blocks": 4})
    d.add("long", list(range(1, 151)), max_tokens=2,
          params={"do_remote_prefill": True, "kvd_flow": "push", "kvd_key": "L"})
    _, meta = d.step()
    assert [(lo.key, lo.remote_blocks, lo.first, len(lo.block_ids), lo.parts)
            for lo in meta.loads] == [("L#p0", 4, 0, 4, 3), ("L#p1", 4, 0, 4, 3),
                                      ("L#p2", 2, 0, 2, 3)]


def test_bad_extra_config_is_refused() -> None:
    with pytest.raises(Exception, match="unknown kv_connector_extra_config keys"):
        Sched("kv_consumer", {"kvd_sokcet": "/tmp/x"})
    with pytest.raises(Exception, match="flow must be one of"):
        Sched("kv_consumer", {"flow": "sideways"})
    with pytest.raises(Exception, match="staging_blocks must be an integer >= 1"):
        Sched("kv_consumer", {"staging_blocks": "many"})
    with pytest.raises(Exception, match="kvd_socket must be a non-empty string"):
        Sched("kv_consumer", {"kvd_socket": 7})


# ---------------------------------------------------------------- scheduler: decode side


def test_consumer_async_load_then_runs() -> None:
    d = Sched("kv_consumer", {})
    d.add("x", list(range(1, 41)), max_tokens=4, params=remote("k1", 40))
    so, meta = d.step()
    assert not so.num_scheduled_tokens  # waiting for its KV
    (load,) = meta.loads
    assert load == LoadOrder("x", "k1", "10.0.0.1:7700", 3, 0, load.block_ids, 30.0)
    assert len(load.block_ids) == 3
    so, meta = d.step()
    assert not so.num_scheduled_tokens and not meta.loads  # still waiting, asked once
    d.step(KVConnectorOutput(finished_recving={"x"}))
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"x": 1}  # only the last prompt token is recomputed

    # Push flow, sent by the proxy before prefill answered: no counts, they follow from
    # the prompt.
    d.add("early", list(range(300, 340)), max_tokens=2,
          params={"do_remote_prefill": True, "kvd_flow": "push", "kvd_key": "prx/e"})
    _, meta = d.step()
    (load,) = meta.loads
    assert (load.key, load.source, load.remote_blocks, load.first) == ("prx/e", None, 3, 0)

    # A miss (no params) and broken params both prefill locally.
    d.add("miss", list(range(100, 140)))
    d.add("bad", list(range(200, 240)), params=remote("k2", 39))  # another prompt's KV
    so, meta = d.step()
    assert so.num_scheduled_tokens.get("miss") == 40 and so.num_scheduled_tokens.get("bad") == 40
    assert not meta.loads


def test_consumer_local_prefix_hit_loads_only_the_rest() -> None:
    d = Sched("kv_consumer", {})
    prompt = list(range(1, 41))
    d.add("warm", [*prompt, 99], max_tokens=1)
    d.step()  # computes and caches the first two full blocks
    d.add("y", prompt, max_tokens=2, params=remote("k3", 40))
    _, meta = d.step()
    (load,) = meta.loads
    assert (load.first, load.remote_blocks, len(load.block_ids)) == (2, 3, 1)


def test_consumer_drops_the_pushed_parts_it_will_not_load() -> None:
    """Push flow: parts that decode will not load are ordered released (at decode's
    daemon, and at prefill's when decode knows it), so none crosses the wire or waits in
    decode's daemon for prefill's lease to end."""
    d = Sched("kv_consumer", {"push_part_blocks": 2, "load_timeout_s": 7})
    prompt = list(range(1, 71))  # 70 tokens: 5 blocks, parts 2 + 2 + 1
    push = {"do_remote_prefill": True, "kvd_flow": "push"}

    def dropped(req: str, key: str, sender: str | None = None) -> list[DiscardOrder]:
        return [DiscardOrder(req, f"{key}#p{j}", sender) for j in range(3)]

    # Prefill's counts do not fit this prompt: decode computes it and drops every part.
    d.add("misfit", prompt, params={**push, "kvd_key": "m", "kvd_num_tokens": 69})
    so, meta = d.step()
    assert so.num_scheduled_tokens == {"misfit": 70} and not meta.loads
    assert meta.discards == dropped("misfit", "m")
    # Aborted before it was scheduled: it never loads.
    d.add("gone", list(range(100, 170)), params={**push, "kvd_key": "g",
                                                  "kvd_source": "prefill:7"})
    d.s.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    _, meta = d.step()
    assert meta.discards == dropped("gone", "g", "prefill:7") and not meta.loads
    # Prefill's part size wins over decode's own; the pull flow leaves prefill's key alone.
    d.add("warm", [*range(200, 232), 1])  # caches 2 blocks
    d.step()
    d.add("hit", list(range(200, 270)), params={**push, "kvd_key": "h", "kvd_push_parts": 1})
    d.add("pull", [*range(200, 232), *range(500, 538)], params=remote("pl", 70))
    _, meta = d.step()
    assert meta.discards == [DiscardOrder("hit", "h#p0"), DiscardOrder("hit", "h#p1")]
    assert [(lo.key, lo.first) for lo in meta.loads] == [("h#p2", 0), ("h#p3", 0),
                                                          ("h#p4", 0), ("pl", 2)]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_consumer_failed_load_follows_the_policy(policy: str) -> None:
    d = Sched("kv_consumer", {}, policy=policy)
    d.add("z", list(range(1, 41)), max_tokens=3, params=remote("k4", 40))
    _, meta = d.step()
    (load,) = meta.loads
    so, meta = d.step(KVConnectorOutput(finished_recving={"z"},
                                        invalid_block_ids=set(load.block_ids)))
    if policy == "fail":
        assert d.finished["z"].finish_reason.name == "ERROR"
        assert d.free_blocks() == NUM_BLOCKS - 1  # all back (block 0 is vLLM's null block)
    else:
        so, meta = d.step()
        assert so.num_scheduled_tokens == {"z": 40} and not meta.loads  # recomputed here


def test_consumer_abort_while_loading_frees_once_the_load_ends() -> None:
    d = Sched("kv_consumer", {})
    free = d.free_blocks()
    d.add("w", list(range(1, 41)), max_tokens=3, params=remote("k5", 40))
    d.step()
    d.s.finish_requests("w", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert d.free_blocks() == free - 3  # the worker may still be writing into them
    d.step(KVConnectorOutput(finished_recving={"w"}))
    assert d.free_blocks() == free


def test_consumer_preempted_after_its_load_recomputes_instead_of_loading_again() -> None:
    d = Sched("kv_consumer", {}, num_blocks=9)  # 8 usable blocks of 16 tokens
    d.add("local", list(range(1, 41)), max_tokens=60)
    d.step()
    d.add("remote", list(range(100, 140)), max_tokens=60, params=remote("k6", 40))
    _, meta = d.step()
    assert [lo.req_id for lo in meta.loads] == ["remote"]
    d.step(KVConnectorOutput(finished_recving={"remote"}))
    loads, preempted = [], False
    for _ in range(80):  # both decode until the blocks run out and one is preempted
        so, meta = d.step()
        loads += meta.loads
        preempted = preempted or d.s.requests["remote"].num_preemptions > 0
        if preempted and so.num_scheduled_tokens.get("remote", 0) > 1:
            break
    assert preempted and not loads  # recomputed locally, not loaded a second time
    assert so.num_scheduled_tokens["remote"] > 1


# ---------------------------------------------------------------- worker side


@pytest.fixture(scope="module")
def two_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ProcessDaemon]]:
    ds = start_daemons(str(tmp_path_factory.mktemp("workers")), "p", "d")
    yield ds
    for d in ds:
        assert d.stop() == 0, d.log()


def cpu_kv(seed: int, block_dim: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's CPU layout ([N, H, bs, 2*D], blocks on dim 0, layers views of one
    allocation), or the older FlashAttention one ([2, N, bs, H, D], blocks on dim 1)."""
    gen = torch.Generator().manual_seed(seed)
    if block_dim == 0:
        whole = torch.randn((len(LAYERS), NUM_BLOCKS, 2, BLOCK, 64), generator=gen)
    else:
        whole = torch.randn((len(LAYERS), 2, NUM_BLOCKS, BLOCK, 2, 32), generator=gen)
    return {name: whole[i] for i, name in enumerate(LAYERS)}


@contextlib.contextmanager
def worker_connectors(*confs: VllmConfig) -> Iterator[list[Any]]:
    """Worker connectors as vLLM builds them, one per config: the first through
    ``ensure_kv_transfer_initialized`` (one worker connector per process is vLLM's rule),
    the others from the factory that it uses; shut down and torn down after."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.kv_transfer import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
    )

    conns: list[Any] = []
    try:
        with set_current_vllm_config(confs[0]):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)
            ensure_kv_transfer_initialized(confs[0], kv_cache_config())
            conns.append(get_kv_transfer_group())
        conns += [KVConnectorFactory.create_connector(c, KVConnectorRole.WORKER,
                                                      kv_cache_config()) for c in confs[1:]]
        yield conns
    finally:
        for conn in conns[1:]:
            conn.shutdown()
        ensure_kv_transfer_shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.mark.parametrize("block_dim", [0, 1])
def test_worker_connectors_move_blocks_between_daemons(two_daemons: list[ProcessDaemon],
                                                       block_dim: int) -> None:
    pd, dd = two_daemons
    p_conf = vllm_config("kv_producer", {"kvd_socket": pd.socket_path})
    d_conf = vllm_config("kv_consumer", {"kvd_socket": dd.socket_path})
    with worker_connectors(d_conf, p_conf) as (decode, prefill):
        p_kv, d_kv = cpu_kv(1, block_dim), cpu_kv(2, block_dim)
        prefill.register_kv_caches(p_kv)
        decode.register_kv_caches(d_kv)
        key = f"worker-test-{block_dim}"
        # CPU tensors are staged: the producer's blocks are free after its first step.
        sent = step(prefill, KvdConnectorMetadata(sends=[SendOrder("r", key, [5, 9, 2],
                                                                   10.0)]))[0]
        assert sent == {"r"}
        received = step(decode, KvdConnectorMetadata(loads=[
            LoadOrder("r", key, pd.peer_address(), 3, 0, [40, 41, 42], 10.0)]))[1] or set()
        deadline = time.monotonic() + 10
        while "r" not in received:
            assert time.monotonic() < deadline, (sent, received)
            step(prefill, KvdConnectorMetadata())
            received |= step(decode, KvdConnectorMetadata())[1] or set()
        assert not decode.get_block_ids_with_load_errors()
        for name in LAYERS:
            src, dst = p_kv[name].movedim(block_dim, 0), d_kv[name].movedim(block_dim, 0)
            assert torch.equal(dst[40], src[5]) and torch.equal(dst[41], src[9])
            assert torch.equal(dst[42], src[2])
        stats = decode.get_kv_connector_stats()
        assert stats is not None and stats.data["loads"] == 1
        while (p_stats := prefill.get_kv_connector_stats()) is None:  # the loan ends
            assert time.monotonic() < deadline
            step(prefill, KvdConnectorMetadata())
        assert p_stats.data["sends"] == 1 and p_stats.data["sends_unread"] == 0
        assert stats.data["bytes_received"] == 3 * 2 * 2 * BLOCK * 64 * 4
        # One sample per request loaded and per key sent, for the histograms.
        ((seconds, nbytes),) = stats.data["load_samples"]
        assert 0 < seconds < 10 and nbytes == stats.data["bytes_received"]
        ((seconds, nbytes),) = p_stats.data["send_samples"]
        assert 0 < seconds < 10 and nbytes == stats.data["bytes_received"]
        assert decode.get_kv_connector_stats() is None  # (taken: nothing new)

        # A load that cannot succeed: finished, with its blocks reported invalid.
        step(decode, KvdConnectorMetadata(loads=[LoadOrder("lost", "no-such-key", pd.peer_address(),
                                                           1, 0, [50], 0.3)]))
        deadline = time.monotonic() + 10
        while "lost" not in (step(decode, KvdConnectorMetadata())[1] or set()):
            assert time.monotonic() < deadline
        assert decode.get_block_ids_with_load_errors() == {50}


def step(conn: Any, meta: KvdConnectorMetadata) -> tuple[set[str] | None, set[str] | None]:
    """What vLLM's model runner does with a worker connector in one step without a forward."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    conn.wait_for_save()
    done = conn.get_finished(set())
    conn.clear_connector_metadata()
    time.sleep(0.002)
    return done


def worker_output(conn: Any, meta: Any) -> KVConnectorOutput:
    """A worker connector's step on ``meta``, as the KVConnectorOutput vLLM's model runner
    returns to the scheduler."""
    sending, recving = step(conn, meta)
    return KVConnectorOutput(finished_sending=sending or set(),
                             finished_recving=recving or set(),
                             invalid_block_ids=conn.get_block_ids_with_load_errors())


# ---------------------------------------------------------------- the push flow, both ends


def pool_holds(client: KvdClient) -> tuple[int, int, int]:
    """What a daemon holds: keys, gets waiting for keys, pool bytes in use."""
    st = client.stats()
    return st["keys"], st["waiting_gets"], st["pool"]["used_bytes"]


@pytest.fixture
def fresh_daemons(tmp_path: Any) -> Iterator[list[ProcessDaemon]]:
    ds = start_daemons(str(tmp_path), "p", "d")
    yield ds
    for d in ds:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
def test_push_parts_decode_has_cached_leave_its_pool_at_once(
        fresh_daemons: list[ProcessDaemon], decode_first: bool) -> None:
    """Push flow, both schedulers and both worker connectors, a 150-token prompt (10
    blocks, 5 parts of 2) sent twice, and decode with a local prefix hit: 5 blocks the
    first time (its own earlier request), 9 the second (the first one's). Decode loads
    only the parts past its hit, byte for byte, and releases the parts it has cached.
    When it learns its hit before prefill pushes (the proxy sent both requests at once,
    naming prefill's daemon), those parts never leave prefill, nor does the cached block
    of the part that straddles the hit: only the blocks decode lacks cross the wire.
    When it learns it after
    the parts are in its daemon (sent with prefill's answer), they are dropped there at
    once. Either way its daemon holds nothing right after, not until prefill's 30 s lease
    ends."""
    pd, dd = fresh_daemons
    push = {"flow": "push", "push_part_blocks": 2}
    p_extra = {"kvd_socket": pd.socket_path, "lease_s": 30, **push}
    d_extra = {"kvd_socket": dd.socket_path, "load_timeout_s": 10, **push}
    decode_address, prefill_address = dd.peer_address(), pd.peer_address()
    p = Sched("kv_producer", p_extra, max_batched=64)  # prefill in chunks: parts go early
    d = Sched("kv_consumer", d_extra)
    prompt = list(range(1000, 1150))
    with worker_connectors(vllm_config("kv_consumer", d_extra),
                           vllm_config("kv_producer", p_extra)) as (dw, pw), \
            KvdClient(dd.socket_path) as decode_daemon, \
            KvdClient(pd.socket_path) as prefill_daemon:
        p_kv, d_kv = cpu_kv(3, 0), cpu_kv(4, 0)
        block_bytes = sum(t[0].numel() * t.element_size() for t in p_kv.values())
        pw.register_kv_caches(p_kv)
        dw.register_kv_caches(d_kv)
        d.add("warm", [*prompt[:80], 1])  # decode computes and caches 5 blocks itself
        d.step(worker=dw)
        discarded: list[str] = []
        heads: list[tuple[str, int]] = []  # parts straddling the hit: their cached blocks

        def released_at_prefill() -> tuple[int, int]:
            leases = prefill_daemon.stats()["leases"]
            return leases["released"], leases["released_head"]

        for rnd, hit in enumerate((5, 9)):
            rid, key = f"r{rnd}", f"proxy/{rnd}"
            d_params = {"do_remote_prefill": True, "kvd_flow": "push", "kvd_key": key,
                        "kvd_source": prefill_address}
            sent_before = (pw._mover.stats.bytes_sent, pw._mover.stats.sends_released,
                           pw._mover.stats.bytes_unsent)
            if decode_first:
                d.add(rid, prompt, max_tokens=2, params=d_params)
                # Decode schedules it (a step ahead of prefill, as when prefill computes)
                # and releases the parts it has cached at prefill's daemon, and the first
                # block of the part that straddles its hit.
                released, released_head = released_at_prefill()
                _, meta = d.step(worker=dw)
                discarded += [o.key for o in meta.discards if not o.skip]
                heads += [(o.key, o.skip) for o in meta.discards if o.skip]
                assert heads[-1] == (f"{key}#p{hit // 2}", 1)
                assert [lo.key for lo in meta.loads] == [
                    f"{key}#p{j}" for j in range(hit // 2, 5)]
                d_ids = list(d.s.kv_cache_manager.get_block_ids(rid)[0])
                deadline = time.monotonic() + 5
                while released_at_prefill() < (released + hit // 2, released_head + 1):
                    assert time.monotonic() < deadline, prefill_daemon.stats()["leases"]
                    d.step(worker=dw)
            p.add(rid, prompt, params={"do_remote_decode": True, "kvd_key": key,
                                       "kvd_push_to": decode_address})
            sends: dict[str, list[int]] = {}
            d_ids = d_ids if decode_first else []
            before = {name: t.clone() for name, t in d_kv.items()}
            deadline = time.monotonic() + 20
            while rid not in d.finished:
                assert time.monotonic() < deadline, (sends, d_ids, decode_daemon.stats())
                sends.update((o.key, o.block_ids) for o in p.step(worker=pw)[1].sends)
                if not decode_first and rid not in d.s.requests and rid in p.finished:
                    # Every part is in decode's daemon before decode hears of the request.
                    if decode_daemon.stats()["keys"] < 5:
                        continue
                    d.add(rid, prompt, max_tokens=2,
                          params=p.finished[rid].kv_transfer_params)
                if rid not in d.s.requests:
                    continue
                _, meta = d.step(worker=dw)
                discarded += [o.key for o in meta.discards if not o.skip]
                if not d_ids:
                    d_ids = list(d.s.kv_cache_manager.get_block_ids(rid)[0])
                    assert [lo.key for lo in meta.loads] == [
                        f"{key}#p{j}" for j in range(hit // 2, 5)]
            # Decode's pool is empty now, not when prefill's lease ends.
            deadline = time.monotonic() + 5
            while (left := pool_holds(decode_daemon)) != (0, 0, 0):
                assert time.monotonic() < deadline, f"keys, waiting gets, pool bytes: {left}"
                d.step(worker=dw)
            assert sorted(discarded[-(hit // 2):]) == [f"{key}#p{j}" for j in range(hit // 2)]
            if decode_first:  # only the blocks past the hit crossed the wire
                assert (pw._mover.stats.bytes_sent - sent_before[0],
                        pw._mover.stats.sends_released - sent_before[1],
                        pw._mover.stats.bytes_unsent - sent_before[2]) == (
                    (10 - hit) * block_bytes, hit // 2, hit * block_bytes)
            p_ids = [b for j in range(5) for b in sends[f"{key}#p{j}"]]
            for name in LAYERS:  # the blocks past the hit came from prefill, byte-exact;
                for j in range(10):  # the cached ones were not written
                    want = p_kv[name][p_ids[j]] if j >= hit else before[name][d_ids[j]]
                    assert torch.equal(d_kv[name][d_ids[j]], want), (rnd, j)
        stats = dw._mover.stats
        assert (stats.loads, stats.load_failures, stats.parts_dropped) == (2, 0, 2 + 4)
        assert discarded == [f"proxy/0#p{j}" for j in range(2)] + [
            f"proxy/1#p{j}" for j in range(4)]


# ---------------------------------------------------------------- what vLLM's log shows


@contextlib.contextmanager
def vllm_log(config: VllmConfig) -> Iterator[io.StringIO]:
    """What vLLM's own log handler writes meanwhile: its logging set up from ``config`` as
    each vLLM process does it (an engine, its engine core, its workers), with vLLM's
    format and level."""
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(config.logging_config)
    (handler,) = [h for h in logging.getLogger("vllm").handlers if h.name == "vllm"]
    assert isinstance(handler, logging.StreamHandler)
    out = io.StringIO()
    old = handler.setStream(out)
    try:
        yield out
    finally:
        handler.setStream(old)


def vllm_line(level: str, file: str, text: str) -> re.Pattern[str]:
    """A line in vLLM's format: level, date and time, [file:line], then the message."""
    return re.compile(rf"{level} \d\d-\d\d \d\d:\d\d:\d\d \[{re.escape(file)}:\d+\] .*{text}")


def test_a_daemon_restart_shows_in_vllms_log(tmp_path: Any) -> None:
    """The connector's lines come out in vLLM's log: the daemon going away, the load that
    failed for it (at ERROR, with its cause), and "registered again" once a new daemon
    answers (INFO, which Python's last-resort handler would not print at all)."""
    folder = str(tmp_path)
    daemon = ProcessDaemon(folder)  # stopped in finally, even when not ready in time
    try:
        daemon.wait_ready()
        conf = vllm_config("kv_consumer", {"kvd_socket": daemon.socket_path})
        with worker_connectors(conf) as (conn,):
            conn.register_kv_caches(cpu_kv(5, 0))
            assert daemon.stop() == 0, daemon.log()
            daemon = ProcessDaemon(folder)
            daemon.wait_ready()
            with vllm_log(conf) as out:
                done = step(conn, KvdConnectorMetadata(loads=[
                    LoadOrder("after-restart", "k", None, 1, 0, [3], 5.0)]))
                deadline = time.monotonic() + 10
                while "registered again" not in out.getvalue():
                    assert time.monotonic() < deadline, out.getvalue()
                    step(conn, KvdConnectorMetadata())
            assert done[1] == {"after-restart"} and conn.get_block_ids_with_load_errors() == {3}
            log = out.getvalue()
            for line in (vllm_line("ERROR", "kv_mover.py", "went away"),
                         vllm_line("ERROR", "vllm.py", "request after-restart: its KV did "
                                   "not load .*kv_load_failure_policy=recompute"),
                         vllm_line("INFO", "kv_mover.py", "is back: registered again")):
                assert line.search(log), (line.pattern, log)
            with KvdClient(daemon.socket_path) as c:
                assert c.stats()["regions"] == 1  # the engine's staging, on the new daemon
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_failed_load_shows_its_cause_at_error_in_vllms_log(daemon: ProcessDaemon) -> None:
    """With kv_load_failure_policy=fail the client gets only an error; vLLM's log says
    which request's KV did not load, why, and what vLLM does about it."""
    conf = vllm_config("kv_consumer", {"kvd_socket": daemon.socket_path}, policy="fail")
    with worker_connectors(conf) as (conn,), vllm_log(conf) as out:
        conn.register_kv_caches(cpu_kv(6, 0))
        received = step(conn, KvdConnectorMetadata(loads=[
            LoadOrder("lost", "no-such-key", None, 1, 0, [50], 0.3)]))[1] or set()
        deadline = time.monotonic() + 10
        while "lost" not in received:
            assert time.monotonic() < deadline
            received |= step(conn, KvdConnectorMetadata())[1] or set()
    assert conn.get_block_ids_with_load_errors() == {50}
    line = vllm_line("ERROR", "vllm.py", "request lost: its KV did not load \\(key "
                     "'no-such-key': no key 'no-such-key' arrived within [0-9.]+s\\); "
                     "kv_load_failure_policy=fail: vLLM ends the request with an error")
    assert line.search(out.getvalue()), out.getvalue()


# ---------------------------------------------------------------- sleep mode


def test_sleep_mode_is_declined() -> None:
    """The connector says it cannot follow sleep mode's KV remap: the daemon maps the
    engine's KV in place. vLLM 0.33 asks this (``KVConnectorBase_V1.supports_sleep_mode``,
    a class method given the transfer config) when ``enable_sleep_mode`` is on, through
    the connector factory as below, and refuses to start; vLLM 0.32 does not ask."""
    config = vllm_config("kv_consumer", {})
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls is KvdConnector
    assert cls.supports_sleep_mode(config.kv_transfer_config) is False
    base = getattr(KVConnectorBase_V1, "supports_sleep_mode", None)
    if base is not None:  # the base class has it: the override takes what it takes

        def params(f: Any) -> list[tuple[str, Any]]:
            return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]

        assert params(base) == params(cls.supports_sleep_mode)


# ---------------------------------------------------------------- compatibility


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_engine_of_another_configuration_is_refused_at_once(
        daemon: ProcessDaemon, policy: str) -> None:
    """Prefill says what its KV is (``kvd_compat``); decode compares it with its own. A pair
    that differs (here prefill ran with an fp8 KV cache; its TP=2 may differ) is refused
    before any byte moves, with one ERROR line naming what differs however many requests come, and
    vLLM's kv_load_failure_policy applies: each request is computed here, or fails."""
    d = Sched("kv_consumer", {"kvd_socket": daemon.socket_path}, policy=policy)
    ours = Compat.of(d.config)
    theirs = msgspec.structs.replace(ours, tensor_parallel_size=2, cache_dtype="fp8")
    with worker_connectors(d.config) as (conn,), vllm_log(d.config) as out:
        conn.register_kv_caches(cpu_kv(7, 0))
        started = time.monotonic()
        for i, rid in enumerate(("r1", "r2", "r3")):
            d.add(rid, list(range(100 * i + 1, 100 * i + 41)), max_tokens=2,
                  params=remote(f"k-{rid}", 40, kvd_compat=theirs.as_params()))
        computed: dict[str, int] = {}
        while len(computed) + len(d.finished) < 3:
            assert time.monotonic() - started < 1.0, out.getvalue()
            so, _ = d.step(worker=conn)
            for rid, n in so.num_scheduled_tokens.items():
                computed[rid] = max(computed.get(rid, 0), n)
        took = time.monotonic() - started
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data["loads_refused"] == 3, stats
    print(f"3 requests refused and handled in {took * 1000:.0f} ms")
    if policy == "fail":
        assert {r: o.finish_reason.name for r, o in d.finished.items()} == dict.fromkeys(
            ("r1", "r2", "r3"), "ERROR")
    else:
        assert computed == dict.fromkeys(("r1", "r2", "r3"), 40)  # the prompt, computed here
    log = out.getvalue()
    assert log.count("refusing KV from prefill engines") == 1, log
    line = vllm_line("ERROR", "vllm.py", "refusing KV from prefill engines of another "
                     "configuration \\(cache_dtype: prefill 'fp8', this engine 'auto'\\)")
    assert line.search(log), log
    assert "its KV did not load" not in log  # said once, by the scheduler


def test_prefill_tells_decode_what_its_kv_is(daemon: ProcessDaemon) -> None:
    """The params prefill answers with carry its configuration, and broken ones from a
    proxy are refused as a whole (decode computes the prompt)."""
    p = Sched("kv_producer", {"kvd_socket": daemon.socket_path})
    p.add("a", list(range(1, 41)), params={"do_remote_decode": True})
    p.step()
    params = p.finished["a"].kv_transfer_params
    assert Compat.from_params(params["kvd_compat"]) == Compat.of(p.config)
    d = Sched("kv_consumer", {})
    d.add("b", list(range(1, 41)), params={**params, "kvd_compat": {"model": 7}})
    so, meta = d.step()
    assert so.num_scheduled_tokens == {"b": 40} and not meta.loads


def test_pipeline_parallelism_is_refused_at_start() -> None:
    """Each stage would lend its own layers under the request's one key: the connector
    refuses the combination at start, naming it, rather than let keys clash."""
    for role in ("kv_producer", "kv_consumer"):
        config = vllm_config(role, {})
        config.parallel_config.pipeline_parallel_size = 2
        with pytest.raises(BadRequest, match=f"pipeline_parallel_size=2 on this {role}"):
            KvdConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


# ---------------------------------------------------------------- leases and aborts


def test_consumer_renews_the_lease_of_a_queued_request_and_releases_what_it_drops() -> None:
    """Pull flow. A request that waits in decode's queue (no free blocks) has its lease at
    prefill renewed every half of prefill's lease (``kvd_lease_s``), and no more once it
    is gone; a request that will not load the key (aborted in the queue, aborted while it
    loads, computed here) has it released, once."""
    d = Sched("kv_consumer", {}, num_blocks=9)  # 8 usable blocks
    d.add("local", list(range(1, 97)), max_tokens=50)  # 6 blocks, 7 once it decodes
    d.step()
    d.add("queued", list(range(200, 240)), max_tokens=2,
          params=remote("kq", 40, kvd_lease_s=0.2))  # 3 blocks: it waits
    renews, started = [], time.monotonic()
    while time.monotonic() - started < 0.65:
        so, meta = d.step()
        assert "queued" not in so.num_scheduled_tokens and not meta.loads
        assert not meta.releases
        renews += meta.renews
        time.sleep(0.04)
    assert 4 <= len(renews) <= 7, renews
    assert set(map(repr, renews)) == {repr(RenewOrder("queued", "kq", "10.0.0.1:7700", 0.2))}
    d.s.finish_requests("queued", RequestStatus.FINISHED_ABORTED)
    _, meta = d.step()
    assert meta.releases == [ReleaseOrder("queued", "kq", "10.0.0.1:7700")]
    time.sleep(0.25)
    _, meta = d.step()
    assert not meta.renews and not meta.releases

    # Aborted while its load runs: released too (its pull fails at once at prefill).
    d.s.finish_requests("local", RequestStatus.FINISHED_ABORTED)
    d.add("loading", list(range(300, 340)), max_tokens=2, params=remote("kl", 40))
    _, meta = d.step()
    assert [lo.key for lo in meta.loads] == ["kl"]
    d.s.finish_requests("loading", RequestStatus.FINISHED_ABORTED)
    _, meta = d.step()
    assert meta.releases == [ReleaseOrder("loading", "kl", "10.0.0.1:7700")]
    # Loaded: nothing more about it, whatever comes after.
    d.add("loads", list(range(400, 440)), max_tokens=1, params=remote("kd", 40,
                                                                    kvd_lease_s=0.1))
    d.step()
    d.step(KVConnectorOutput(finished_recving={"loads"}))
    time.sleep(0.1)
    for _ in range(3):
        _, meta = d.step()
        assert not meta.renews and not meta.releases
    assert "loads" in d.finished
    # Computed here (prefill's counts do not fit this prompt): released at once.
    d.add("misfit", list(range(500, 540)), params=remote("km", 39))
    so, meta = d.step()
    assert so.num_scheduled_tokens.get("misfit") == 40
    assert meta.releases == [ReleaseOrder("misfit", "km", "10.0.0.1:7700")]


def prefill_lends(p: Sched, pw: Any, rid: str, prompt: list[int]) -> tuple[dict[str, Any],
                                                                          list[int]]:
    """Prefill runs ``rid`` and lends its blocks: prefill's answer, and its block ids."""
    p.add(rid, prompt, params={"do_remote_decode": True})
    sends: list[Any] = []
    deadline = time.monotonic() + 10
    while not sends:
        assert time.monotonic() < deadline
        sends += p.step(worker=pw)[1].sends
    return p.finished[rid].kv_transfer_params, sends[0].block_ids


def test_a_request_queued_past_the_lease_still_loads(fresh_daemons: list[ProcessDaemon],
                                                     ) -> None:
    """Prefill lends for 1 s; decode's request waits in its queue 2.6 s (its blocks are
    taken by a running request), its lease renewed meanwhile; then it loads, byte for
    byte, from the key prefill still holds."""
    pd, dd = fresh_daemons
    p_extra = {"kvd_socket": pd.socket_path, "lease_s": 1.0}
    d_extra = {"kvd_socket": dd.socket_path, "load_timeout_s": 10}
    p, d = Sched("kv_producer", p_extra), Sched("kv_consumer", d_extra, num_blocks=9)
    prompt = list(range(600, 640))
    with worker_connectors(vllm_config("kv_consumer", d_extra),
                           vllm_config("kv_producer", p_extra)) as (dw, pw), \
            KvdClient(pd.socket_path) as prefill_daemon:
        p_kv, d_kv = cpu_kv(8, 0), cpu_kv(9, 0)
        pw.register_kv_caches(p_kv)
        dw.register_kv_caches(d_kv)
        d.add("local", list(range(1, 97)), max_tokens=50)  # 7 of 8 blocks once it decodes
        d.step(worker=dw)
        params, p_ids = prefill_lends(p, pw, "r", prompt)
        assert params["kvd_lease_s"] == 1.0
        d.add("r", prompt, max_tokens=2, params=params)
        started = time.monotonic()
        while time.monotonic() - started < 2.6:
            so, meta = d.step(worker=dw)
            assert "r" not in so.num_scheduled_tokens and not meta.loads
            p.step(worker=pw)
            time.sleep(0.05)
        assert prefill_daemon.stats()["keys"] == 1  # still lent, 2.6 s into a 1 s lease
        d.s.finish_requests("local", RequestStatus.FINISHED_ABORTED)
        d_ids: list[int] = []
        deadline = time.monotonic() + 10
        while "r" not in d.finished:
            assert time.monotonic() < deadline
            _, meta = d.step(worker=dw)
            d_ids += [b for lo in meta.loads for b in lo.block_ids]
            p.step(worker=pw)
        stats, p_stats = dw._mover.stats, pw._mover.stats
        assert (stats.loads, stats.load_failures) == (1, 0)
        assert 3 <= stats.leases_renewed <= 6, stats
        assert prefill_daemon.stats()["leases"]["renewed"] == stats.leases_renewed
        assert (p_stats.sends, p_stats.sends_unread) == (1, 0)
        assert len(d_ids) == len(p_ids) == 3
        for name in LAYERS:
            for mine, theirs in zip(d_ids, p_ids, strict=True):
                assert torch.equal(d_kv[name][mine], p_kv[name][theirs])


def wait_for(what: str, cond: Any, within_s: float, *step: Any) -> float:
    """Step ``step`` (schedulers with their workers) until ``cond()``; how long it took
    (an AssertionError past ``within_s``)."""
    started = time.monotonic()
    while not cond():
        took = time.monotonic() - started
        assert took < within_s, f"{what}: not within {within_s:g}s"
        for sched, worker in step:
            sched.step(worker=worker)
        time.sleep(0.005)
    return time.monotonic() - started


def test_a_decode_that_aborts_frees_prefills_blocks_at_once(
        fresh_daemons: list[ProcessDaemon]) -> None:
    """Pull flow, prefill's lease 30 s. Decode aborts a request waiting in its queue:
    prefill's daemon holds nothing and prefill's worker has its blocks back within a
    second. Decode aborts a request whose pull waits at prefill before prefill has lent
    (the release comes first): the pull fails at once without an error line, decode's
    blocks are free, and prefill's lend, when it comes, is answered at once."""
    pd, dd = fresh_daemons
    p_extra = {"kvd_socket": pd.socket_path, "lease_s": 30}
    d_extra = {"kvd_socket": dd.socket_path, "load_timeout_s": 20}
    p, d = Sched("kv_producer", p_extra), Sched("kv_consumer", d_extra, num_blocks=9)
    with worker_connectors(vllm_config("kv_consumer", d_extra),
                           vllm_config("kv_producer", p_extra)) as (dw, pw), \
            KvdClient(pd.socket_path) as prefill_daemon, vllm_log(d.config) as out:
        pw.register_kv_caches(cpu_kv(10, 0))
        dw.register_kv_caches(cpu_kv(11, 0))
        p_free, d_free = p.free_blocks(), d.free_blocks()
        d.add("local", list(range(1, 97)), max_tokens=50)
        d.step(worker=dw)
        params, _ = prefill_lends(p, pw, "queued", list(range(700, 740)))
        d.add("queued", list(range(700, 740)), max_tokens=2, params=params)
        d.step(worker=dw)
        assert prefill_daemon.stats()["keys"] == 1
        d.s.finish_requests("queued", RequestStatus.FINISHED_ABORTED)
        took = wait_for("prefill's key released", lambda: pw._mover.stats.sends_released,
                        1.0, (d, dw), (p, pw))
        st = prefill_daemon.stats()
        assert (st["keys"], st["pool"]["used_bytes"], p.free_blocks()) == (0, 0, p_free)
        slots = pw._mover.groups[0].slots
        assert slots.free == slots.count  # its staging, all free
        print(f"aborted in the queue: prefill's blocks back in {took * 1000:.0f} ms")

        # The pull waits at prefill before the lend; decode aborts; then prefill lends.
        d.s.finish_requests("local", RequestStatus.FINISHED_ABORTED)
        d.step(worker=dw)
        p.add("early", list(range(800, 840)), params={"do_remote_decode": True})
        p.step()  # prefill has answered; its worker has not lent yet
        d.add("early", list(range(800, 840)), max_tokens=2,
              params=p.finished["early"].kv_transfer_params)
        _, meta = d.step(worker=dw)
        assert [lo.key for lo in meta.loads] == [
            p.finished["early"].kv_transfer_params["kvd_key"]]
        wait_for("the pull waiting at prefill", lambda: prefill_daemon.stats()[
            "transfers"]["pulls_waiting_for_key"] == 1, 5.0, (d, dw))
        d.s.finish_requests("early", RequestStatus.FINISHED_ABORTED)
        took = wait_for("decode's blocks back", lambda: d.free_blocks() == d_free, 1.0,
                        (d, dw))
        took += wait_for("prefill's lend answered", lambda: pw._mover.stats.sends_released
                         == 2, 1.0, (p, pw))
        st = prefill_daemon.stats()
        assert (st["keys"], st["transfers"]["pulls_waiting_for_key"]) == (0, 0)
        assert p.free_blocks() == p_free and st["leases"]["released"] == 2
        print(f"aborted while its pull waited: both sides' blocks back in {took * 1000:.0f} ms")
        stats = dw._mover.stats
        assert (stats.leases_released, stats.load_failures, stats.loads_gone) == (2, 1, 1)
    assert "its KV did not load" not in out.getvalue()  # the request is gone: no error


def test_push_flow_a_gone_prefill_daemon_fails_the_load_at_once(tmp_path: Any) -> None:
    """Push flow, decode told prefill's daemon (``kvd_source``): a load waiting for parts
    fails within a second when that daemon dies, not after ``load_timeout_s`` (10 s), and
    the policy applies (recompute: the prompt is computed here); a load from a daemon
    already gone fails at once too."""
    pd, dd = start_daemons(str(tmp_path), "p", "d")
    try:
        source = pd.peer_address()
        d_extra = {"kvd_socket": dd.socket_path, "load_timeout_s": 10, "flow": "push"}
        d = Sched("kv_consumer", d_extra)
        with worker_connectors(vllm_config("kv_consumer", d_extra)) as (dw,), \
                KvdClient(dd.socket_path) as decode_daemon:
            dw.register_kv_caches(cpu_kv(12, 0))
            push = {"do_remote_prefill": True, "kvd_flow": "push", "kvd_source": source}
            d.add("waits", list(range(1, 41)), max_tokens=2, params={**push, "kvd_key": "w"})
            _, meta = d.step(worker=dw)
            assert [(lo.key, lo.sender) for lo in meta.loads] == [("w", source)]
            wait_for("decode linked to prefill's daemon",
                     lambda: decode_daemon.stats()["peer"]["links"], 5.0)
            pd.proc.kill()
            pd.proc.wait(10)
            computed: dict[str, int] = {}

            def computing(rid: str) -> bool:
                so, _ = d.step(worker=dw)
                computed.update(so.num_scheduled_tokens)
                return computed.get(rid) == 40

            took = wait_for("the load failed and the prompt computed",
                            lambda: computing("waits"), 1.5)
            d.add("later", list(range(100, 140)), max_tokens=2,
                  params={**push, "kvd_key": "l"})
            took_later = wait_for("a load from a gone daemon", lambda: computing("later"),
                                  1.0)
            stats = dw._mover.stats
            assert stats.load_failures == 2 and stats.loads == 0
        print(f"prefill's daemon died: load failed and recomputed in {took * 1000:.0f} ms; "
              f"one from a daemon gone before: {took_later * 1000:.0f} ms")
    finally:
        pd.stop(timeout_s=0)
        assert dd.stop() == 0, dd.log()


def test_push_flow_a_decode_that_aborts_leaves_nothing_in_either_daemon(
        fresh_daemons: list[ProcessDaemon]) -> None:
    """Push flow (what the proxy does: decode hears first). Decode aborts the request while
    it waits in its queue; prefill then pushes its parts: decode's daemon takes and drops
    them as they come, and neither daemon holds anything within a second."""
    pd, dd = fresh_daemons
    push = {"flow": "push", "push_part_blocks": 2}
    p_extra = {"kvd_socket": pd.socket_path, **push}
    d_extra = {"kvd_socket": dd.socket_path, "load_timeout_s": 10, **push}
    p, d = Sched("kv_producer", p_extra), Sched("kv_consumer", d_extra, num_blocks=9)
    prompt = list(range(900, 970))  # 5 blocks: 3 parts
    with worker_connectors(vllm_config("kv_consumer", d_extra),
                           vllm_config("kv_producer", p_extra)) as (dw, pw), \
            KvdClient(dd.socket_path) as decode_daemon, \
            KvdClient(pd.socket_path) as prefill_daemon:
        pw.register_kv_caches(cpu_kv(13, 0))
        dw.register_kv_caches(cpu_kv(14, 0))
        d.add("local", list(range(1, 97)), max_tokens=50)
        d.step(worker=dw)
        d.add("r", prompt, max_tokens=2, params={"do_remote_prefill": True,
                                                  "kvd_flow": "push", "kvd_key": "ab"})
        d.step(worker=dw)
        d.s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        d.step(worker=dw)
        p.add("r", prompt, params={"do_remote_decode": True, "kvd_key": "ab",
                                   "kvd_push_to": dd.peer_address()})
        wait_for("prefill's parts sent", lambda: pw._mover.stats.sends == 3, 10.0, (p, pw))

        def empty() -> bool:
            return (pool_holds(decode_daemon) == (0, 0, 0) == pool_holds(prefill_daemon)
                    and dw._mover.stats.parts_dropped == 3)

        took = wait_for("both daemons empty, the parts dropped", empty, 1.0, (d, dw))
    print(f"aborted decode: the pushed parts dropped, both daemons empty in "
          f"{took * 1000:.0f} ms")
