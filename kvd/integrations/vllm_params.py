"""What the vLLM connector is given from outside, checked: its settings
(``kv_connector_extra_config``, once at start) and what a request's ``kv_transfer_params``
may carry for kvd, and how decode reads them.

A proxy sets the params (see ``examples/vllm/``); prefill answers with them. A broken set
is refused with ``BadRequest``, never half used. Apart from the connector so that they
read, and are checked, without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvd.errors import BadRequest
from kvd.integrations.vllm_compat import Compat

FLOWS = ("pull", "push")
MAX_KEY_CHARS = 512  # kvd takes up to 1024; the connector keeps room for its own keys
_COUNTS = ("kvd_num_tokens", "kvd_num_blocks", "kvd_block_size")


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked once at start."""

    kvd_socket: str | None = None
    kvd_address: str | None = None
    flow: str = "pull"
    lease_s: float = 30.0
    load_timeout_s: float = 30.0
    # CPU engines: shared-memory blocks their KV goes through (None: the longest request's
    # blocks or 256, whichever is more; see KvdConnector)
    staging_blocks: int | None = None
    push_part_blocks: int = 64  # push flow: send a long prompt in parts as they are written

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise BadRequest(f"unknown kv_connector_extra_config keys {unknown}; "
                             f"KvdConnector knows {sorted(known)}")
        settings = cls(**extra)
        for name in ("kvd_socket", "kvd_address"):
            value = getattr(settings, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise BadRequest(f"{name} must be a non-empty string, got {value!r}")
        if settings.flow not in FLOWS:
            raise BadRequest(f"flow must be one of {FLOWS}, got {settings.flow!r}")
        for name in ("lease_s", "load_timeout_s"):
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise BadRequest(f"{name} must be a positive number, got {value!r}")
        for name, least in (("staging_blocks", 1), ("push_part_blocks", 0)):
            value = getattr(settings, name)
            if value is None and name == "staging_blocks":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise BadRequest(f"{name} must be an integer >= {least}, got {value!r}")
        return settings


def key_param(params: dict[str, Any]) -> str | None:
    """A key chosen by the proxy (push flow, sent to both instances up front)."""
    key = params.get("kvd_key")
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise BadRequest(f"kvd_key must be a string of 1..{MAX_KEY_CHARS} characters")
    return key


def push_target(params: dict[str, Any]) -> tuple[str | None, str]:
    """Prefill, push flow: the key the proxy chose (None: none; decode may be waiting for
    it already), and the decode daemon to put to."""
    key = key_param(params)
    push_to = params.get("kvd_push_to")
    if not isinstance(push_to, str) or not push_to:
        raise BadRequest("push flow, but the proxy named no decode daemon (kvd_push_to)")
    return key, push_to


@dataclass(frozen=True)
class RemotePrefill:
    """What decode reads from a request's ``kv_transfer_params``. The counts come from
    prefill's answer; a proxy that sends to decode before prefill has answered (push flow)
    leaves them out, and they follow from the prompt."""

    key: str
    source: str | None  # the prefill daemon (pull flow); None: pushed to us
    num_tokens: int | None
    num_blocks: int | None
    block_size: int | None
    push_parts: int | None = None  # prefill's push_part_blocks, when it told us
    compat: Compat | None = None  # what prefill's KV is (None: not told, push flow early)
    lease_s: float | None = None  # how long prefill keeps the blocks, when it told us
    sender: str | None = None  # push flow: the prefill daemon that pushes, when told

    @property
    def their_tp(self) -> int:
        """Prefill's tensor-parallel size, when it said (0: not said)."""
        return self.compat.tensor_parallel_size if self.compat else 0

    @classmethod
    def of(cls, params: Any) -> RemotePrefill | None:
        """None when the request has no KV to load; ``BadRequest`` when it claims to but
        the params are broken."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        key, flow = key_param(params), params.get("kvd_flow", "pull")
        if key is None or flow not in FLOWS:
            raise BadRequest(f"kv_transfer_params need kvd_key and a kvd_flow in {FLOWS}")
        nums = [params.get(k) for k in _COUNTS]
        if flow == "pull" and None in nums:
            raise BadRequest(f"pull flow without {[k for k in _COUNTS if k not in params]}")
        if not all(n is None or (isinstance(n, int) and n > 0) for n in nums):
            raise BadRequest(f"bad token/block counts {nums}")
        source = params.get("kvd_source")
        if flow == "pull" and not (isinstance(source, str) and source):
            raise BadRequest("pull flow without kvd_source")
        if source is not None and not (isinstance(source, str) and source):
            raise BadRequest(f"bad kvd_source {source!r}")
        parts = params.get("kvd_push_parts")
        if parts is not None and not (isinstance(parts, int) and parts >= 0):
            raise BadRequest(f"bad kvd_push_parts {parts!r}")
        lease = params.get("kvd_lease_s")
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int | float)
                                  or not 0 < lease <= 1e7):
            raise BadRequest(f"bad kvd_lease_s {lease!r}")
        return cls(key, source if flow == "pull" else None, nums[0], nums[1], nums[2], parts,
                   Compat.from_params(params.get("kvd_compat")),
                   None if lease is None else float(lease),
                   source if flow == "push" else None)

