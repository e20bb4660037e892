"""KvdConnector with vLLM's hybrid KV cache manager, without a model: vLLM's own
scheduler, ``KVCacheConfig`` and KV tensors for two hybrid models, driven step by step.

The models are the configs of ``tests/fixtures/tiny_gemma3`` (sliding-window and full
attention layers) and ``tiny_qwen3_next`` (GDN layers, a recurrent state, and full
attention). Their layers' KV cache specs are made here as vLLM's workers report them;
vLLM groups them (``get_kv_cache_configs``: one group per kind, every group laid over one
allocation) and allocates the tensors (``allocate_kv_cache``). Prefill's scheduler and
worker connector send each group of a request through one `kvd serve` daemon, decode's
load them through another, and the bytes of each group's blocks are compared where they
land. Runs only where vLLM imports.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvd.errors import BadRequest
from kvd.integrations.kv_orders import LoadOrder
from kvd.integrations.vllm import KvdConnector, KvdConnectorMetadata
from kvd.integrations.vllm_compat import Compat
from tests.conftest import ProcessDaemon, start_daemons
from tests.gpu_nodes import free_port

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NUM_BLOCKS = 48
_hash = get_hash_fn_by_name("sha256")
init_none_hash(_hash)


@dataclass(frozen=True)
class Model:
    folder: str
    dtype: str
    block: int
    specs: Callable[[], dict[str, KVCacheSpec]]  # per layer, as vLLM's workers report them
    groups: tuple[str, ...]  # what kvd_compat names, in vLLM's group order


def gemma3_specs() -> dict[str, KVCacheSpec]:
    kw: dict[str, Any] = {"block_size": 32, "num_kv_heads": 2, "head_size": 32,
                          "dtype": torch.float32}
    return {f"model.layers.{i}.self_attn.attn": (
        SlidingWindowSpec(sliding_window=64, **kw) if i % 2 == 0 else FullAttentionSpec(**kw))
        for i in range(4)}


def qwen3_next_specs() -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=128,
                             dtype=torch.bfloat16)
    # GDN: a conv state (kernel - 1, q + k + v dims) and the recurrent state (heads, k, v),
    # padded to the attention page, as vLLM's CPU platform sizes them for this config.
    state = MambaSpec(block_size=128, shapes=((3, 384), (1, 128, 128)),
                      dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=full.page_size_bytes,
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    return {"model.layers.0.linear_attn": state, "model.layers.1.self_attn.attn": full,
            "model.layers.2.linear_attn": state, "model.layers.3.self_attn.attn": full}


MODELS = {
    "gemma3": Model("tiny_gemma3", "float32", 32, gemma3_specs, ("sliding:64", "full")),
    "qwen3_next": Model("tiny_qwen3_next", "bfloat16", 128, qwen3_next_specs,
                        ("state", "full")),
}


def hybrid(model: Model, role: str, extra: dict[str, Any], policy: str = "recompute",
           max_batched: int = 512) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's config for ``model`` with KvdConnector, and the KV cache config vLLM makes
    of its layers' specs (the engine core's part: the layout, then the groups)."""
    config = VllmConfig(
        model_config=ModelConfig(model=os.path.join(FIXTURES, model.folder),
                                 skip_tokenizer_init=True, dtype=model.dtype,
                                 max_model_len=512, seed=0),
        cache_config=CacheConfig(block_size=model.block, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched,
                                         max_model_len=512, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
            kv_role=role, kv_load_failure_policy=policy, kv_connector_extra_config=extra))
    specs = model.specs()
    resolve_kv_cache_layout(config, [[KvdConnector.get_required_kvcache_layout(config)]],
                            specs.values())
    page = max(s.page_size_bytes for s in specs.values())
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [NUM_BLOCKS * page * 2])
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return config, kv_cache_config


class Sched:
    """vLLM's scheduler for a hybrid model with KvdConnector; the engine's side played by
    hand (``tests/test_vllm_connector.Sched``, for several KV cache groups)."""

    def __init__(self, model: Model, role: str, extra: dict[str, Any],
                 policy: str = "recompute", max_batched: int = 512) -> None:
        self.model = model
        self.config, self.kv_cache_config = hybrid(model, role, extra, policy, max_batched)
        self.s = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                           structured_output_manager=StructuredOutputManager(self.config),
                           block_size=model.block, log_stats=True)
        self.finished: dict[str, Any] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 1,
            params: dict[str, Any] | None = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        req = Request(rid, prompt, sp, None,
                      block_hasher=get_request_block_hasher(self.model.block, _hash))
        self.s.add_request(req)
        return req

    def step(self, kv: KVConnectorOutput | None = None, worker: Any = None,
             ) -> tuple[Any, KvdConnectorMetadata, KVConnectorOutput]:
        """One schedule() and its output (each request whose prompt is now computed
        samples token 7), with the worker's ``kv``; with a ``worker`` connector, the
        step's metadata goes through it and its transfer results are the step's."""
        so = self.s.schedule()
        if worker is not None:
            kv = worker_output(worker, so.kv_connector_metadata)
        ids = list(so.num_scheduled_tokens)
        reqs = [self.s.requests[r] for r in ids]
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] if q.num_computed_tokens >=
                                                   q.num_prompt_tokens else [] for q in reqs],
                                kv_connector_output=kv or KVConnectorOutput())
        for outputs in self.s.update_from_output(so, out).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        assert isinstance(so.kv_connector_metadata, KvdConnectorMetadata)
        return so, so.kv_connector_metadata, kv

    def ids(self, rid: str) -> tuple[list[int], ...]:
        return self.s.kv_cache_manager.get_block_ids(rid)

    def free_blocks(self) -> int:
        return int(self.s.kv_cache_manager.block_pool.get_num_free_blocks())


def worker_output(conn: Any, meta: Any) -> KVConnectorOutput:
    """What vLLM's model runner does with a worker connector in a step without a
    forward (``kv_connector_model_runner_mixin``), as the step's KVConnectorOutput."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    conn.wait_for_save()
    done = conn.get_transfer_results(set())
    conn.clear_connector_metadata()
    time.sleep(0.002)
    return KVConnectorOutput(finished_sending=done.finished_sending,
                             finished_recving=done.finished_recving,
                             failed_recving=done.failed_recving,
                             invalid_block_ids=conn.get_block_ids_with_load_errors())


@contextlib.contextmanager
def worker_connectors(*scheds: Sched) -> Iterator[list[Any]]:
    """A worker connector per scheduler, as vLLM builds them with its KV cache config:
    the first through ``ensure_kv_transfer_initialized``, the others from the factory."""
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
        with set_current_vllm_config(scheds[0].config):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)
            ensure_kv_transfer_initialized(scheds[0].config, scheds[0].kv_cache_config)
            conns.append(get_kv_transfer_group())
        conns += [KVConnectorFactory.create_connector(s.config, KVConnectorRole.WORKER,
                                                      s.kv_cache_config) for s in scheds[1:]]
        yield conns
    finally:
        for conn in conns[1:]:
            conn.shutdown()
        ensure_kv_transfer_shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()


def kv_tensors(sched: Sched, seed: int) -> dict[str, torch.Tensor]:
    """The KV tensors vLLM's worker allocates for this KV cache config (groups laid over
    one allocation), filled with random bytes."""
    kv = allocate_kv_cache(sched.kv_cache_config, torch.device("cpu"),
                           sched.config.cache_config.get_resolved_kv_cache_layout())
    raw = torch.empty(0, dtype=torch.int8).set_(next(iter(kv.values())).untyped_storage())
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8,
                            generator=torch.Generator().manual_seed(seed)))
    return kv


def page(kv: dict[str, torch.Tensor], layer: str, block: int) -> torch.Tensor:
    """A layer's block as bytes (random bytes read as floats may be NaN)."""
    return kv[layer][block].contiguous().view(torch.int8).clone()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ProcessDaemon]]:
    ds = start_daemons(str(tmp_path_factory.mktemp("hybrid")), "p", "d")
    yield ds
    for d in ds:
        assert d.stop() == 0, d.log()


@pytest.fixture(params=sorted(MODELS))
def model(request: Any) -> Model:
    return MODELS[request.param]


# ---------------------------------------------------------------- the groups vLLM sees


def test_vllm_keeps_its_hybrid_kv_cache_manager_on(model: Model) -> None:
    """vLLM turns its hybrid KV cache manager off for a connector without ``SupportsHMA``
    (a hybrid SSM model then fails at start); with KvdConnector it stays on, and the
    connector moves each of vLLM's groups."""
    sched = Sched(model, "kv_consumer", {})
    assert supports_hma(KvdConnector)
    assert sched.config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert len(sched.kv_cache_config.kv_cache_groups) == 2
    connector = sched.s.connector
    assert isinstance(connector, KvdConnector)
    assert connector.layout.names == model.groups
    assert connector.get_loaded_kv_cache_group_ids(None) == (0, 1)


def test_a_group_kvd_cannot_move_stops_the_engine_at_start() -> None:
    config, kv_cache_config = hybrid(MODELS["gemma3"], "kv_consumer", {})
    chunked = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                        dtype=torch.float32, attention_chunk_size=64)
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = chunked
    with pytest.raises(BadRequest, match="cannot move KV cache group 0 "
                                         r"\(ChunkedLocalAttentionSpec"):
        KvdConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


# ---------------------------------------------------------------- scheduler and workers


def prompt_of(model: Model) -> list[int]:
    """Long enough that the first blocks are out of Gemma's window of 64 tokens, and
    that Qwen3-Next has several blocks of 128."""
    return list(range(1, 151)) if model.block == 32 else list(range(1, 301))


@pytest.mark.parametrize("flow", ["pull", "push"])
def test_each_group_moves_between_workers(daemons: list[ProcessDaemon], model: Model,
                                          flow: str) -> None:
    """Prefill's scheduler and worker send a request group by group; decode's load each
    group into its own blocks. Gemma 3: the full-attention group moves every block, the
    sliding-window group only the blocks still in the window (vLLM freed the others on
    both sides). Qwen3-Next: prefill computes all but the prompt's last token, its state
    block moves, and decode computes that token on it. In the push flow decode waits first
    and prefill is chunked: the full-attention group's parts go while prefill runs.
    Bytes compared block by block; decode then schedules the last prompt token only."""
    pd, dd = daemons
    push = {"flow": "push", "push_part_blocks": 1} if flow == "push" else {}
    p = Sched(model, "kv_producer", {"kvd_socket": pd.socket_path, **push},
              max_batched=2 * model.block)
    d = Sched(model, "kv_consumer", {"kvd_socket": dd.socket_path, "load_timeout_s": 10, **push})
    prompt, rid, key = prompt_of(model), f"r-{flow}", f"proxy/{flow}"
    tokens = len(prompt) - 1  # (kv_groups.backoff: prefill leaves the last token out)
    n = -(-tokens // model.block)
    with worker_connectors(d, p) as (dw, pw):
        p_kv, d_kv = kv_tensors(p, 1), kv_tensors(d, 2)
        pw.register_kv_caches(p_kv)
        dw.register_kv_caches(d_kv)
        if flow == "push":
            d.add(rid, prompt, max_tokens=2, params={"do_remote_prefill": True,
                                                     "kvd_flow": "push", "kvd_key": key})
            p.add(rid, prompt, params={"do_remote_decode": True, "kvd_key": key,
                                       "kvd_push_to": dd.peer_address()})
        else:
            p.add(rid, prompt, params={"do_remote_decode": True})
        free = p.free_blocks()
        sends, early = [], 0
        deadline = time.monotonic() + 20
        while rid not in p.finished:
            assert time.monotonic() < deadline
            _, meta, _ = p.step(worker=pw)
            sends += meta.sends
            early = early or len(sends)
        held = p.free_blocks()  # delay_free: the finished request's blocks wait for the send
        params = p.finished[rid].kv_transfer_params
        assert params["kvd_num_tokens"] == tokens and params["kvd_num_blocks"] == n
        assert tuple(params["kvd_compat"]["kv_groups"]) == model.groups
        p_ids = p.ids(rid)  # held for the send (vLLM freed what falls out of the window)
        if flow == "pull":
            d.add(rid, prompt, max_tokens=2, params=params)
        loads: list[LoadOrder] = []
        while True:
            assert time.monotonic() < deadline, (loads, sends)
            sends += p.step(worker=pw)[1].sends
            so, meta, _ = d.step(worker=dw)
            loads += meta.loads
            if so.num_scheduled_tokens.get(rid):
                break
        assert so.num_scheduled_tokens == {rid: 1}  # only the last prompt token
        d_ids = d.ids(rid)
        assert {o.key for o in sends} == {o.key for o in loads}
        moved = check_groups(model, p, d, p_ids, d_ids, p_kv, d_kv, tokens, n)
        assert sum(len(o.block_ids) for o in sends) == moved
        if flow == "push":  # the full group's first part went before prefill finished
            assert early and all(o.group == 1 and not o.final for o in sends[:early])
        assert held < free
        while p.free_blocks() != free:
            assert time.monotonic() < deadline  # the blocks come back once sent
            p.step(worker=pw)


def check_groups(model: Model, p: Sched, d: Sched, p_ids: tuple[list[int], ...],
                 d_ids: tuple[list[int], ...], p_kv: dict[str, torch.Tensor],
                 d_kv: dict[str, torch.Tensor], tokens: int, n: int) -> int:
    """Each group's blocks at decode are prefill's, byte for byte; the blocks moved."""
    moved = 0
    for gid, group in enumerate(p.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):  # the state: the last block of the list
            pairs = [(p_ids[gid][-1], d_ids[gid][-1])]
        else:
            first = (max(0, tokens - spec.sliding_window + 1) // spec.block_size
                     if isinstance(spec, SlidingWindowSpec) else 0)
            assert not any(p_ids[gid][:first]) and not any(d_ids[gid][:first])  # null
            assert all(p_ids[gid][first:n]) and all(d_ids[gid][first:n])
            pairs = list(zip(p_ids[gid][first:n], d_ids[gid][first:n], strict=True))
            if isinstance(spec, SlidingWindowSpec):
                assert first > 0 and len(pairs) < n  # the window: fewer blocks than all
        for layer in group.layer_names:
            for a, b in pairs:
                assert torch.equal(page(p_kv, layer, a), page(d_kv, layer, b)), (layer, a, b)
        moved += len(pairs)
    return moved


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_of_several_groups_follows_the_policy(
        daemons: list[ProcessDaemon], policy: str) -> None:
    """vLLM takes no block ids for a failed load when it has several KV cache groups (it
    raises): the worker reports the request in ``failed_recving`` once every group's
    load has ended, and ``kv_load_failure_policy`` applies: the prompt is computed here,
    or the request fails."""
    model = MODELS["gemma3"]
    d = Sched(model, "kv_consumer", {"kvd_socket": daemons[1].socket_path,
                                     "load_timeout_s": 0.5}, policy=policy)
    prompt = prompt_of(model)
    theirs = Compat.of(d.config, model.groups).as_params()
    params = {"do_remote_prefill": True, "kvd_key": "never-lent", "kvd_flow": "pull",
              "kvd_source": daemons[0].peer_address(), "kvd_num_tokens": len(prompt) - 1,
              "kvd_num_blocks": 5, "kvd_block_size": 32, "kvd_compat": theirs}
    with worker_connectors(d) as (dw,):
        dw.register_kv_caches(kv_tensors(d, 3))
        d.add("z", prompt, max_tokens=2, params=params)
        outputs: list[KVConnectorOutput] = []
        scheduled: dict[str, int] = {}
        deadline = time.monotonic() + 10
        while "z" not in d.finished and not scheduled:
            assert time.monotonic() < deadline
            so, _, kv = d.step(worker=dw)
            outputs.append(kv)
            scheduled = dict(so.num_scheduled_tokens)
    (failed,) = [kv for kv in outputs if kv.failed_recving]
    assert failed.failed_recving == failed.finished_recving == {"z"}
    assert not any(kv.invalid_block_ids for kv in outputs)
    if policy == "fail":
        assert d.finished["z"].finish_reason.name == "ERROR"
    else:
        assert scheduled == {"z": len(prompt)}  # computed here, from the first token


@pytest.mark.parametrize("prompt_len", [127, 150])
def test_decode_holds_every_block_its_first_token_attends_to(prompt_len: int) -> None:
    """Sliding window 64, blocks of 32: the token decode computes first, once its load is
    in, attends to the 64 tokens up to it, and each block they are in must be decode's
    (not vLLM's null block). Were decode handed all 127 tokens, it would recompute token
    126 with the blocks vLLM keeps for token 127: token 63's block (1) freed, on
    prefill's side too. (Push flow, told before prefill: decode counts the tokens itself.)"""
    d = Sched(MODELS["gemma3"], "kv_consumer", {})
    d.add("w", list(range(1, prompt_len + 1)), max_tokens=2,
          params={"do_remote_prefill": True, "kvd_flow": "push", "kvd_key": "k"})
    _, meta, _ = d.step()
    assert {o.group for o in meta.loads} == {0, 1}
    d.step(KVConnectorOutput(finished_recving={"w"}))
    so = d.s.schedule()
    first = d.s.requests["w"].num_computed_tokens - so.num_scheduled_tokens["w"]
    ids = d.ids("w")[0]  # the sliding-window group's
    need = range((first - 64 + 1) // 32, first // 32 + 1)
    assert all(ids[b] for b in need), (first, ids, list(need))


# ---------------------------------------------------------------- what may differ


def test_pairs_that_cannot_move_a_hybrid_models_kv_are_refused() -> None:
    """Prefill and decode must have the same groups (a prefill with vLLM's hybrid KV
    cache manager off has one); tensor-parallel sizes may differ for attention groups,
    not for a recurrent state, which vLLM cuts over the ranks by the model's own heads."""
    gemma = Compat.of(hybrid(MODELS["gemma3"], "kv_consumer", {})[0], MODELS["gemma3"].groups)
    one_group = msgspec.structs.replace(gemma, kv_groups=())
    assert "kv_groups: prefill (), this engine ('sliding:64', 'full')" in gemma.refusal(
        one_group)
    assert "kv_groups" not in one_group.as_params()  # as a connector before groups sent it
    assert gemma.refusal(msgspec.structs.replace(gemma, tensor_parallel_size=2)) == ""
    qwen = Compat.of(hybrid(MODELS["qwen3_next"], "kv_consumer", {})[0],
                     MODELS["qwen3_next"].groups)
    assert qwen.refusal(msgspec.structs.replace(qwen, tensor_parallel_size=1)) == ""
    why = qwen.refusal(msgspec.structs.replace(qwen, tensor_parallel_size=2))
    assert why.startswith("tensor_parallel_size: prefill 2, this engine 1 (a hybrid model's "
                          "recurrent (Mamba) state")


def test_a_state_moves_only_with_a_token_left_out(daemons: list[ProcessDaemon]) -> None:
    """A one-token prompt of a model with a recurrent state: prefill has no token to
    leave out, so its state holds the whole prompt and decode could not compute the last
    token on it. Prefill offers nothing; decode computes the prompt itself."""
    model = MODELS["qwen3_next"]
    p = Sched(model, "kv_producer", {"kvd_socket": daemons[0].socket_path})
    p.add("one", [5], params={"do_remote_decode": True})
    p.add("many", [5, 6, 7], params={"do_remote_decode": True})
    so, _, _ = p.step()
    assert so.num_scheduled_tokens == {"one": 1, "many": 2}  # (the last token left out)
    assert p.finished["one"].kv_transfer_params is None
    params = p.finished["many"].kv_transfer_params
    assert params["kvd_num_tokens"] == 2
    d = Sched(model, "kv_consumer", {})
    d.add("one", [5], params={**params, "kvd_num_tokens": 1, "kvd_num_blocks": 1})
    so, meta, _ = d.step()
    assert so.num_scheduled_tokens == {"one": 1} and not meta.loads
