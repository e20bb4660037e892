"""``KvdConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) on kvd daemons.

Load it in both instances of a disaggregated pair::

    --kv-transfer-config '{"kv_connector": "KvdConnector",
                           "kv_connector_module_path": "kvd.integrations.vllm",
                           "kv_role": "kv_producer",          # decode: "kv_consumer"
                           "kv_connector_extra_config": {"kvd_socket": "/run/kvd/kvd.sock"}}'

Extra config (all optional): ``vllm_params.Settings``; docs/vllm.md has the table.

The request-level protocol (``kv_transfer_params``, set by a proxy, see
``examples/vllm/``):

- to prefill: ``{"do_remote_decode": true}`` (push flow: plus ``"kvd_push_to":
  "<decode daemon host:port>"`` and, optionally, the ``kvd_key`` to put under). When the
  request finishes, prefill keeps its blocks (``delay_free``) and answers with the params
  for decode: ``do_remote_prefill``, ``kvd_key``, ``kvd_source`` (its daemon),
  ``kvd_flow``, ``kvd_num_tokens``, ``kvd_num_blocks``, ``kvd_block_size``, ``kvd_compat``
  (what its KV is: ``vllm_compat``; decode refuses KV that does not fit it, saying once
  what differs, and the failure policy applies). Pull flow: the
  blocks are lent under the key until decode's daemon pulls them or the lease ends; push
  flow: they are put to the decode daemon at once. Either way prefill frees them when kvd
  is done with them.
- to decode: those params; or, push flow, sent at the same time as to prefill:
  ``{"do_remote_prefill": true, "kvd_flow": "push", "kvd_key": <the same key>}``, so that
  decode is already waiting when the blocks come (plus ``kvd_source``, the prefill daemon,
  when the proxy knows it: decode's wait then fails at once if that daemon is gone).
  Decode claims the prompt's tokens that it has not cached as an asynchronous load, pulls
  (or takes the pushed) blocks into its own, and reports the request done. Pushed parts
  that it has cached itself (or all of them, when it computes the prompt itself) it takes
  and drops, so that none waits in its daemon's pool. Pull flow: while a request waits in
  decode's queue, decode renews prefill's lease (prefill's ``lease_s``, sent as
  ``kvd_lease_s``) every half lease; a request that will not load the key (aborted,
  computed here, refused, its load failed) releases it, and prefill frees its blocks at
  once. A load that fails or times out is logged at ERROR with its cause and reported as
  invalid blocks, so vLLM's ``kv_load_failure_policy`` applies (recompute, or fail the
  request).

The module imports without vLLM; the classes need it (``ImportError`` naming it if not).
Inside vLLM it logs under vLLM's own ``vllm`` logger, so that its lines come out in
vLLM's log. The data path is ``kvd.integrations.kv_mover``, which knows nothing about
vLLM. Beside this module: ``vllm_params`` (the extra config and the request-level params
above, checked) and ``vllm_stats`` (counters for vLLM's stats and Prometheus registry).

Hybrid models (``SupportsHMA``): ``vllm_groups`` reads vLLM's KV cache groups, each group
of a request moves under ``kvd_key#g<i>`` (``kv_groups``: which blocks, the orders), and
the worker's mover registers each group apart (``kv_mover``).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvd.client.sync import KvdClient
from kvd.errors import BadRequest, KvdError
from kvd.integrations import kv_groups
from kvd.integrations.kv_groups import STATE, backoff, blocks_for, group_key
from kvd.integrations.kv_mover import KvMover
from kvd.integrations.kv_orders import (
    DiscardOrder,
    LoadOrder,
    ReleaseOrder,
    RenewOrder,
    SendOrder,
)
from kvd.integrations.kv_ranks import Read, lends, reads
from kvd.integrations.vllm_compat import Compat
from kvd.integrations.vllm_groups import layout_of
from kvd.integrations.vllm_params import RemotePrefill, Settings, push_target

log = logging.getLogger(__name__)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.v1.request import RequestStatus

    from kvd.integrations.vllm_stats import KvdConnectorStats, KvdPromMetrics

    _VLLM_ERROR: ImportError | None = None
    # vLLM configures one logger, "vllm" (its handler, format and level; propagation stops
    # there): a logger outside that tree reaches no handler in a vLLM process, so INFO
    # lines vanish and the rest go bare to stderr. The connector and its mover log here.
    log = logging.getLogger(f"vllm.{__name__}")
except ImportError as exc:  # kvd never depends on vLLM: only using the classes needs it
    _VLLM_ERROR = exc

if TYPE_CHECKING:
    import torch

_POLICY_OUTCOME = {  # what vLLM does with a failed load, per kv_load_failure_policy
    "fail": "kv_load_failure_policy=fail: vLLM ends the request with an error",
    "recompute": "kv_load_failure_policy=recompute: what did not load is computed here",
}
_NAMES = ("KvdConnector", "KvdConnectorMetadata", "KvdConnectorStats", "KvdPromMetrics")


def _remote_prefill(request: Any, say: bool = False) -> RemotePrefill | None:
    """What the request loads; None if nothing, or if its params are broken (said once,
    when ``say``: by ``get_num_new_matched_tokens``; decode then computes the prompt)."""
    try:
        return RemotePrefill.of(request.kv_transfer_params)
    except BadRequest as err:
        if say:
            log.warning("request %s: ignoring kv_transfer_params: %s", request.request_id,
                        err.message)
        return None


@dataclass(eq=False)
class _Pushing:
    """A push-flow request on prefill: its parts go while its prefill still runs."""

    request: Any
    key: str
    push_to: str
    sent: int = 0  # parts sent so far


@dataclass(eq=False)
class _Held:
    """Decode, pull flow: a request whose KV prefill keeps for it, from its arrival until
    its load has ended. Its lease is renewed every half lease meanwhile."""

    key: str
    source: str
    lease_s: float
    renew_at: float  # time.monotonic()
    their_tp: int = 0  # prefill's tensor-parallel size, when told


def _rank_key(key: str, rank: int, tp: int) -> str:
    """The key tensor-parallel rank ``rank`` of ``tp`` sends its KV heads under."""
    return f"{key}#tp{rank}" if tp > 1 else key


def _client(settings: Settings, name: str) -> KvdClient:
    client = KvdClient(settings.kvd_socket, name=name)
    client.connect()
    return client


if _VLLM_ERROR is None:

    @dataclass
    class KvdConnectorMetadata(KVConnectorMetadata):
        """Scheduler to worker, every step: what to send and what to load."""

        sends: list[SendOrder] = field(default_factory=list)
        loads: list[LoadOrder] = field(default_factory=list)
        discards: list[DiscardOrder] = field(default_factory=list)
        renews: list[RenewOrder] = field(default_factory=list)
        releases: list[ReleaseOrder] = field(default_factory=list)

    class KvdConnector(KVConnectorBase_V1, SupportsHMA):
        """Disaggregated prefill/decode through kvd: see the module docstring. Hybrid
        models (``SupportsHMA``): each KV cache group moves under its own key
        (``kv_groups``)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            transfer = vllm_config.kv_transfer_config
            stages = vllm_config.parallel_config.pipeline_parallel_size
            if stages > 1:
                # Each stage's workers hold their own layers and would lend them under the
                # request's one key: refused, not a silent clash of keys.
                raise BadRequest(
                    f"KvdConnector does not support pipeline parallelism yet "
                    f"(pipeline_parallel_size={stages} on this {transfer.kv_role}): "
                    "run prefill and decode with pipeline_parallel_size=1")
            self.settings = Settings.parse(transfer.kv_connector_extra_config)
            self.engine_id = transfer.engine_id or secrets.token_hex(8)
            self.is_producer = bool(transfer.is_kv_producer)
            policy = str(getattr(transfer, "kv_load_failure_policy", "fail"))
            self._outcome = _POLICY_OUTCOME.get(policy, f"kv_load_failure_policy={policy}")
            self.block_size = vllm_config.cache_config.block_size
            self.num_blocks = (kv_cache_config.num_blocks if kv_cache_config is not None
                               else vllm_config.cache_config.num_gpu_blocks)
            # CPU engines' staging: room for the longest request a transfer may carry (a
            # larger one fails), or 256 blocks, whichever is more, unless set.
            longest = blocks_for(vllm_config.model_config.max_model_len, self.block_size)
            self.staging_blocks = self.settings.staging_blocks or max(256, longest)
            # The KV cache groups it moves (one, full attention, unless the model is
            # hybrid), and the prompt tokens decode computes itself (kv_groups.backoff).
            self.layout = layout_of(kv_cache_config, self.block_size)
            self._backoff = backoff(self.layout.groups)
            # What this engine's KV is: prefill tells decode (kvd_compat), decode refuses
            # KV that does not fit it.
            self.compat = Compat.of(vllm_config, self.layout.names)
            # scheduler side
            self._meta = KvdConnectorMetadata()  # the orders for the worker's next step
            self._held: dict[str, _Held] = {}  # decode: pull-flow requests until loaded
            self._next_renewal = float("inf")  # the earliest _Held.renew_at
            self._pushing: dict[str, _Pushing] = {}
            self._backed_off: set[str] = set()  # prefill: prompts that lost their last token
            self._refused: dict[str, str] = {}  # decode: requests refused, and why
            self._said: set[Compat] = set()  # decode: prefill configurations refused
            self.address = self.settings.kvd_address or ""
            # worker side
            self._client: Any = None
            self._mover: KvMover | None = None
            self._load_errors: set[int] = set()
            self._tp_rank, self._tp = 0, self.compat.tensor_parallel_size
            # KV heads as kv_ranks counts them: an MLA latent cache is one that every
            # rank holds.
            self._heads = 1 if self.compat.use_mla else self.compat.num_kv_heads
            self._reported: dict[str, Any] = {}
            if role == KVConnectorRole.SCHEDULER and self.is_producer and not self.address:
                self.address = self._daemon_address()
            if role == KVConnectorRole.WORKER:
                self._client = _client(self.settings, f"vllm-worker-{self.engine_id}")

        def _daemon_address(self) -> str:
            client = _client(self.settings, f"vllm-scheduler-{self.engine_id}")
            try:
                address = str(client.stats()["peer"]["address"] or "")
            finally:
                client.close()
            if not address:
                raise BadRequest("the kvd daemon has no peer address (is its peer plane "
                                 "off?); set kvd_address in kv_connector_extra_config")
            return address

        # ------------------------------------------------------------ scheduler side

        def on_new_request(self, request: Any) -> None:
            """Decode, pull flow: prefill keeps this request's blocks for it from now on
            (renewed while it waits in the queue, released if it will not load them).
            Prefill: a prompt may lose its last token (``_back_off``)."""
            if self.is_producer:
                self._back_off(request)
                return
            remote = _remote_prefill(request)
            if remote is not None and remote.source is not None:
                self._hold(request.request_id, remote)

        def _hold(self, req_id: str, remote: RemotePrefill) -> None:
            if req_id in self._held or remote.source is None:
                return
            lease_s = remote.lease_s or self.settings.lease_s
            renew_at = time.monotonic() + lease_s / 2
            self._held[req_id] = _Held(remote.key, remote.source, lease_s, renew_at,
                                       remote.their_tp)
            self._next_renewal = min(self._next_renewal, renew_at)

        def _release(self, req_id: str, remote: RemotePrefill | _Held | None) -> None:
            """Prefill may free what it lent for this request: it will not be loaded."""
            self._held.pop(req_id, None)
            if remote is not None and remote.source is not None:
                self._meta.releases.append(ReleaseOrder(req_id, remote.key, remote.source,
                                                        remote.their_tp))

        def _renewals(self) -> None:
            """Renew the leases of the requests still waiting, every half lease each."""
            now = time.monotonic()
            if now < self._next_renewal:
                return
            self._next_renewal = float("inf")
            for req_id, held in self._held.items():
                if now >= held.renew_at:
                    held.renew_at = now + held.lease_s / 2
                    self._meta.renews.append(RenewOrder(req_id, held.key, held.source,
                                                        held.lease_s, held.their_tp))
                self._next_renewal = min(self._next_renewal, held.renew_at)

        def update_connector_output(self, connector_output: Any) -> None:
            for req_id in connector_output.finished_recving or ():
                self._held.pop(req_id, None)  # loaded, or failed (its worker released it)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                       ) -> tuple[int | None, bool]:
            remote = _remote_prefill(request, say=True)
            if remote is None:
                return 0, False
            prompt = self._tokens(request)
            if self._backoff and prompt == len(request.prompt_token_ids):
                return 0, False  # no token to leave out (kv_groups.backoff): computed here
            expected = (prompt, blocks_for(prompt, self.block_size), self.block_size)
            offered = (remote.num_tokens, remote.num_blocks, remote.block_size)
            if any(o is not None and o != e for o, e in zip(offered, expected, strict=True)):
                log.warning("request %s: prefill's KV (tokens, blocks, block size %s) does "
                            "not fit this prompt %s: recomputing", request.request_id,
                            offered, expected)
                return 0, False
            count = prompt - num_computed_tokens
            if count <= 0:
                return 0, False
            if remote.compat is not None and (why := self.compat.refusal(remote.compat)):
                # Claimed all the same: the worker fails the load at once, and vLLM's
                # kv_load_failure_policy decides (recompute here, or fail the request).
                self._refused[request.request_id] = why
                self._say_refused(remote.compat, why)
            return count, True

        def _say_refused(self, theirs: Compat, why: str) -> None:
            """One ERROR line per prefill configuration that does not fit this engine."""
            if theirs in self._said:
                return
            self._said.add(theirs)
            log.error("kvd: refusing KV from prefill engines of another configuration (%s); "
                      "%s, for this request and every other one from such an engine", why,
                      self._outcome)

        def _tokens(self, request: Any) -> int:
            """The prompt tokens that move: all but the ones decode computes itself
            (``kv_groups.backoff``; prefill's prompt lost them already, ``on_new_request``)."""
            prompt = len(request.prompt_token_ids)
            if self.is_producer or prompt <= self._backoff:
                return prompt
            return prompt - self._backoff

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            if self.is_producer and self.settings.flow == "push":
                self._track_push(request)
            remote = _remote_prefill(request)
            if remote is None:
                return
            request.kv_transfer_params["do_remote_prefill"] = False  # load it once only
            tokens = self._tokens(request)
            if num_external_tokens <= 0:  # decode computes the prompt itself
                self._forgo(request.request_id, remote, tokens)
                return
            n = blocks_for(tokens, self.block_size)
            ids = self._group_ids(blocks.get_block_ids())
            load = kv_groups.Loading(
                request.request_id, remote.key, remote.source, tokens,
                n - blocks_for(num_external_tokens, self.block_size),
                self.settings.load_timeout_s, self._push_parts(remote),
                remote.their_tp, remote.sender)
            why = self._refused.pop(request.request_id, "")
            if not why:
                try:
                    loads, drops = kv_groups.loads(self.layout.groups, load, ids)
                except BadRequest as err:  # (not when both ends follow kv_groups' rules)
                    why = f"its blocks do not fit this engine's: {err.message}"
                    log.error("kvd: request %s: %s; %s", request.request_id, why, self._outcome)
            if why:  # nothing of it is loaded
                self._forgo(request.request_id, remote, tokens)
                self._meta.loads += kv_groups.refused_loads(self.layout.groups, load, ids, why)
                return
            self._hold(request.request_id, remote)  # (if on_new_request did not)
            # Parts wholly inside the local prefix hit: released, never loaded (push flow).
            self._meta.discards += drops
            self._meta.loads += loads

        def _group_ids(self, all_groups: Any) -> list[list[int]]:
            """A request's block ids in each group the connector moves, of vLLM's lists
            for all groups."""
            return [list(all_groups[gid]) for gid in self.layout.ids]

        def _push_parts(self, remote: RemotePrefill) -> int:
            """The blocks per part prefill sends in (pulled: one part)."""
            if remote.source is not None:
                return 0
            return (self.settings.push_part_blocks if remote.push_parts is None
                    else remote.push_parts)

        def _forgo(self, req_id: str, remote: RemotePrefill, tokens: int) -> None:
            """The request will not load what prefill sends it. Pushed keys are released by
            the worker: dropped from this daemon if they came before this, refused if they
            come later, and (when prefill's daemon is known) never sent; left alone, each
            would hold the daemon's pool until prefill's lease ends. A lent key is released
            at prefill (``_release``)."""
            if remote.source is None:
                keys = kv_groups.keys_of(self.layout.groups, remote.key, tokens,
                                         self._push_parts(remote))
                self._meta.discards += kv_groups.discards(self.layout.groups, keys, req_id,
                                                          remote.sender, remote.their_tp)
            self._release(req_id, remote)

        def _back_off(self, request: Any) -> None:
            """Prefill of a model with a recurrent state or a sliding window
            (``kv_groups.backoff``): the prompt loses its last token, so that what is
            handed to decode is what that token needs (decode computes it itself), and
            one token is sampled (it goes nowhere: the proxy keeps decode's). As
            NixlConnector does for a state; vLLM keeps a request's tokens in
            ``_all_token_ids`` too."""
            params = request.kv_transfer_params
            prompt = request.prompt_token_ids
            if not (self.is_producer and self._backoff and isinstance(params, dict)
                    and params.get("do_remote_decode") and prompt is not None
                    and len(prompt) > self._backoff):
                return
            request.prompt_token_ids = prompt[:-self._backoff]
            del request._all_token_ids[-self._backoff:]
            request.num_prompt_tokens -= self._backoff
            request.max_tokens = 1
            self._backed_off.add(request.request_id)

        def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
            """A load writes every group the connector moves (vLLM then does not zero the
            blocks allocated for it)."""
            return tuple(self.layout.ids)

        def _track_push(self, request: Any) -> None:
            """Prefill, push flow: remember the request so that its parts can go as soon
            as their blocks are written (``build_connector_meta``)."""
            params = request.kv_transfer_params
            if request.request_id in self._pushing or not (
                    isinstance(params, dict) and params.get("do_remote_decode")):
                return
            try:
                key, push_to = push_target(params)
            except BadRequest:
                return  # request_finished reports it
            self._pushing[request.request_id] = _Pushing(request, key or self._new_key(request),
                                                         push_to)

        def _new_key(self, request: Any) -> str:
            return f"vllm/{self.engine_id}/{request.request_id}/{secrets.token_hex(4)}"

        def _send_written_parts(self) -> None:
            """Push the parts of running prefills whose blocks the last steps wrote (all but
            the last part, which goes when the request finishes). They go through staging:
            a running request's blocks may be reused (preemption) before a send ends."""
            for entry in self._pushing.values():
                req = entry.request
                if req.status != RequestStatus.RUNNING:
                    continue
                # Tokens scheduled but not yet computed are "in flight" (async scheduling).
                written = req.num_computed_tokens - getattr(req, "num_in_flight_tokens", 0)
                sends, entry.sent = kv_groups.written_sends(
                    self.layout.groups, self._sending(req, entry.key, entry.push_to),
                    written, entry.sent, functools.partial(self._running_ids, req))
                self._meta.sends += sends

        def _running_ids(self, request: Any) -> list[list[int]]:
            return self._group_ids(self._kv_cache_manager.get_block_ids(request.request_id))

        def _sending(self, request: Any, key: str, push_to: str | None) -> kv_groups.Sending:
            return kv_groups.Sending(
                request.request_id, key, self._tokens(request), self.settings.lease_s,
                push_to, self.settings.push_part_blocks if push_to is not None else 0)

        def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
            if self._pushing:
                self._send_written_parts()
            if self._held:
                self._renewals()
            meta, self._meta = self._meta, KvdConnectorMetadata()
            return meta

        def has_pending_push_work(self) -> bool:
            """Orders not yet handed to the worker (a release after an abort, say) keep
            vLLM's engine stepping until they are: prefill's blocks are not left until
            decode's next request."""
            return bool(self._meta.releases or self._meta.discards or self._meta.renews)

        def request_finished(self, request: Any, block_ids: list[int],
                             ) -> tuple[bool, dict[str, Any] | None]:
            """vLLM without its hybrid KV cache manager: one group."""
            return self.request_finished_all_groups(request, (block_ids,))

        def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                        ) -> tuple[bool, dict[str, Any] | None]:
            """``SupportsHMA``: a finished request's block ids in each KV cache group."""
            pushing = self._pushing.pop(request.request_id, None)
            backed_off = request.request_id in self._backed_off
            self._backed_off.discard(request.request_id)
            held = self._held.get(request.request_id)
            if not self._drop_unloaded(request) and held is not None:
                self._release(request.request_id, held)  # aborted while its load runs
            params = request.kv_transfer_params
            if not (self.is_producer and isinstance(params, dict)
                    and params.get("do_remote_decode")):
                return False, None
            if request.status not in (RequestStatus.FINISHED_STOPPED,
                                      RequestStatus.FINISHED_LENGTH_CAPPED):
                return False, None  # aborted or failed: nothing worth sending
            if self._backoff and not backed_off:
                return False, None  # nothing left out (kv_groups.backoff): decode computes
            prompt = len(request.prompt_token_ids)
            n = blocks_for(prompt, self.block_size)
            if n == 0 or request.num_computed_tokens < prompt:
                return False, None
            try:
                key, push_to = (push_target(params) if self.settings.flow == "push"
                                else (None, None))
                if pushing is not None:
                    key = pushing.key
                sending = self._sending(request, key or self._new_key(request), push_to)
                # What is left to send: the blocks stay ours till then.
                self._meta.sends += kv_groups.finished_sends(
                    self.layout.groups, sending, self._group_ids(block_ids),
                    pushing.sent if pushing is not None else 0)
            except BadRequest as err:
                log.error("request %s: %s; decode will recompute", request.request_id,
                          err.message)
                return False, None
            return True, {
                "do_remote_prefill": True, "do_remote_decode": False, "kvd_key": sending.key,
                "kvd_source": self.address, "kvd_flow": self.settings.flow,
                "kvd_num_tokens": prompt, "kvd_num_blocks": n,
                "kvd_block_size": self.block_size, "kvd_push_parts": sending.part_blocks,
                "kvd_lease_s": self.settings.lease_s, "kvd_compat": self.compat.as_params(),
            }

        def _drop_unloaded(self, request: Any) -> bool:
            """A request that ends before decode ordered its load (aborted while it waited
            to be scheduled) wants none of the parts pushed for it, nor the key lent for
            it. Whether it was such a request."""
            self._refused.pop(request.request_id, None)
            remote = _remote_prefill(request)
            if remote is None:
                return False
            request.kv_transfer_params["do_remote_prefill"] = False
            self._forgo(request.request_id, remote, self._tokens(request))
            return True

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
            """A block's KV heads outermost (vLLM's ``LBHNC``: layer, block, head, token,
            content), so that a tensor-parallel rank's heads are one equal byte range of
            each block, which the daemon reads and writes in place when prefill and decode
            split the heads over different numbers of ranks (``kv_ranks``). The CPU
            backend has only this layout; NixlConnector asks for the same. An MLA cache
            has no heads to split: any layout."""
            model = getattr(vllm_config, "model_config", None)
            return None if model is None or model.use_mla else "LBHNC"

        @classmethod
        def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
            """No: vLLM (0.33 on) then refuses ``enable_sleep_mode`` with this connector at
            start. The daemon maps GPU KV in place (CUDA IPC), and sleep frees or remaps
            that memory under the mapping; registering again after wake-up, as after a
            daemon restart, has not been run where sleep mode runs (CUDA, ROCm)."""
            return False

        # ------------------------------------------------------------ worker side

        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            from vllm.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self._tp_rank = get_tensor_model_parallel_rank()
            self._tp = get_tensor_model_parallel_world_size()
            layers = list(kv_caches.values())
            groups = ([layers] if len(self.layout.groups) == 1
                      else self._group_layers(kv_caches))
            # A hybrid model: a client per KV cache group (the first one the connector's).
            clients = [_client(self.settings, f"vllm-worker-{self.engine_id}-g{g}")
                       for g in range(1, len(groups))]
            try:
                self._mover = KvMover(self._client, groups[0], self.num_blocks,
                                      self.staging_blocks, f"vllm-{self.engine_id}", log,
                                      list(zip(clients, groups[1:], strict=True)))
            except BaseException:
                for client in clients:
                    client.close()
                raise
            log.info("kvd: registered %d KV tensors in %d group(s) (%d blocks, %s, %s)",
                     len(layers), len(self.layout.groups), self.num_blocks, layers[0].device,
                     "in place" if self._mover.direct else
                     f"{self.staging_blocks} staging blocks of shared memory, "
                     f"{self.staging_blocks * self._mover.block_bytes / 2**20:.0f} MiB")

        def _group_layers(self, kv_caches: dict[str, torch.Tensor],
                          ) -> list[list[torch.Tensor]]:
            """A hybrid model's KV tensors, per KV cache group the connector moves."""
            for g, names in enumerate(self.layout.layers):
                missing = [n for n in names if n not in kv_caches]
                if missing or not names:
                    raise BadRequest(f"KV cache group {g}: no KV tensors for layers "
                                     f"{missing or names}")
            return [[kv_caches[n] for n in names] for names in self.layout.layers]

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            if self._mover is None or not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvdConnectorMetadata)
            # With tensor parallelism each rank that holds heads no lower rank holds sends
            # them under its own key; each rank of decode reads its heads from the ranks
            # of prefill that lend them (kv_ranks).
            for order in meta.sends:
                if lends(self._tp_rank, self._tp, self._group_heads(order.group)):
                    self._mover.send(replace(order, key=_rank_key(order.key, self._tp_rank,
                                                                  self._tp)))
                else:
                    self._mover.skip(order)
            for load in meta.loads:
                try:
                    taken = self._reads(load.their_tp, load.group)
                except BadRequest as err:  # (the scheduler refuses such pairs first)
                    self._mover.load(replace(load, refusal=err.message))
                    continue
                for read in taken:
                    self._mover.load(replace(
                        load, key=_rank_key(load.key, read.rank, load.their_tp or self._tp),
                        part=read.part, readers=read.readers, into=read.into,
                        parts=load.parts * len(taken)))
            for discard in meta.discards:  # (a refused pair's pushed keys end with their lease)
                for key in self._lenders_keys(discard.key, discard.their_tp, discard.group):
                    self._mover.discard(replace(discard, key=key))
            # Renewals and releases: of each key of prefill's that this rank reads.
            leases: list[RenewOrder | ReleaseOrder] = [*meta.renews, *meta.releases]
            for lease in leases:
                for group in range(self.layout.count):  # (each group's key of it)
                    keyed = group_key(lease.key, group, self.layout.count)
                    for key in self._lenders_keys(keyed, lease.their_tp, group):
                        ranked = replace(lease, group=group, key=key)
                        if isinstance(ranked, RenewOrder):
                            self._mover.renew(ranked)
                        else:
                            self._mover.release(ranked)

        def _lenders_keys(self, key: str, their_tp: int, group: int) -> list[str]:
            """The keys of ``key`` at the prefill ranks this rank reads; none for a pair
            this rank cannot read (the scheduler refused it)."""
            try:
                taken = self._reads(their_tp, group)
            except BadRequest:
                return []
            return [_rank_key(key, rank, their_tp or self._tp)
                    for rank in sorted({read.rank for read in taken})]

        def _reads(self, their_tp: int, group: int = 0) -> list[Read]:
            """What this rank reads of prefill's ranks (``their_tp`` 0: prefill did not say
            how many it has, and is taken to have as many as this engine)."""
            their_tp = their_tp or self._tp
            if their_tp != self._tp and self.layout.groups[group].kind == STATE:
                raise BadRequest(f"prefill's tensor_parallel_size={their_tp} and decode's "
                                 f"{self._tp}: a recurrent state moves between equal sizes")
            return reads(self._tp_rank, self._tp, their_tp, self._group_heads(group))

        def _group_heads(self, group: int) -> int:
            """The heads of a group as ``kv_ranks`` counts them: an attention group's KV
            heads; a recurrent state is split over the ranks by the model's own heads, so
            that every rank holds (and sends, and reads) a state of its own."""
            return self._tp if self.layout.groups[group].kind == STATE else self._heads

        def wait_for_layer_load(self, layer_name: str) -> None:
            return  # loads are asynchronous: the scheduler runs a request once it is in

        def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                          **kwargs: Any) -> None:
            return  # blocks leave whole, once the request is finished (request_finished)

        def wait_for_save(self) -> None:
            return

        def get_finished(self, finished_req_ids: set[str],
                         ) -> tuple[set[str] | None, set[str] | None]:
            done = self.get_transfer_results(finished_req_ids)
            return done.finished_sending or None, done.finished_recving or None

        def get_transfer_results(self, finished_req_ids: set[str],
                                 ) -> KVConnectorTransferResults:
            """Sends done, loads ended, and of those the ones that failed: reported as
            invalid blocks where vLLM has one KV cache group, as failed requests where it
            has several (block ids then do not name a request's blocks)."""
            if self._mover is None:
                return KVConnectorTransferResults()
            polled = self._mover.poll()
            for req_id, blocks in polled.failed.items():
                if self.layout.count == 1:
                    self._load_errors.update(blocks)
                if req_id in polled.refused or req_id in polled.aborted:
                    continue  # (the scheduler said why, once; or the request is gone)
                # With policy "fail" the client sees only an error: the cause is here.
                log.error("kvd: request %s: its KV did not load (%s); %s", req_id,
                          polled.causes.get(req_id, "cause unknown"), self._outcome)
            # A failed load is finished too: its blocks are reported invalid.
            return KVConnectorTransferResults(
                finished_sending=polled.released,
                finished_recving=polled.loaded | set(polled.failed),
                failed_recving=set(polled.failed) if self.layout.count > 1 else set())

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors, self._load_errors = self._load_errors, set()
            return errors

        def get_kv_connector_stats(self) -> KvdConnectorStats | None:
            if self._mover is None:
                return None
            now = self._mover.stats.as_dict()
            delta: dict[str, Any] = {k: v - self._reported.get(k, 0) for k, v in now.items()}
            delta.update(self._mover.stats.take_samples())
            self._reported = now
            stats = KvdConnectorStats(data=delta)
            return None if stats.is_empty() else stats

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                     ) -> KvdConnectorStats:
            return KvdConnectorStats(data=dict(data or {}))

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                               labelnames: list[str],
                               per_engine_labelvalues: dict[int, list[object]],
                               ) -> KvdPromMetrics:
            return KvdPromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

        def shutdown(self) -> None:
            mover, self._mover = self._mover, None
            if mover is not None:
                try:
                    mover.close()
                except KvdError as err:
                    log.warning("kvd connector shutdown: %s", err)
            elif self._client is not None:
                self._client.close()
            self._client = None

else:

    def __getattr__(name: str) -> Any:
        if name in _NAMES:
            raise ImportError(f"kvd.integrations.vllm.{name} needs vLLM, which does not "
                              f"import here: {_VLLM_ERROR}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
