"""The vLLM connector's settings (``kv_connector_extra_config``), checked once at start.

Apart from the connector so that they read, and are checked, without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvd.errors import BadRequest

FLOWS = ("pull", "push")


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

