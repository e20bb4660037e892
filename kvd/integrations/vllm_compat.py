"""Whether a prefill engine's KV fits a decode engine: what both must agree on, and what
differs when they do not.

Prefill puts its ``Compat`` in the params it answers with (``kvd_compat``); decode
compares it with its own before it loads anything. A pair that differs is refused at once,
with one ERROR line naming what differs, and vLLM's ``kv_load_failure_policy`` decides
what happens to the request (recompute it, or fail it): bytes laid out for another model,
dtype, block size or parallel layout would load without an error and decode garbage.

Read from vLLM's config only, so that it reads without vLLM's types here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvd.errors import BadRequest
from kvd.integrations.kv_groups import STATE
from kvd.integrations.kv_ranks import check_pair
from kvd.protocol import PROTOCOL_VERSION

# What the connector's own wire (the params, the keys, the layout it registers) means:
# bumped on any change that an older connector would misread.
#   2: KV heads outermost in a block (LBHNC); a rank's key is read in parts (kv_ranks).
CONNECTOR_VERSION = 2
# May differ between prefill and decode: decode reads its heads from prefill's ranks.
_MAY_DIFFER = ("tensor_parallel_size",)


class Compat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What both engines of a pair must agree on, one field each."""

    model: str  # the served model name: the same weights, not only the same shapes
    architecture: str
    num_layers: int
    num_kv_heads: int  # in all, before tensor parallelism splits them
    head_size: int
    use_mla: bool
    dtype: str  # the model's
    cache_dtype: str  # the KV cache's ("auto": the model's; "fp8", ...)
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kvd_protocol: int
    connector: int
    # A hybrid model's KV cache groups (kv_groups.Group.name each); () for one group of
    # full attention, and then left out of the params, as before groups were.
    kv_groups: tuple[str, ...] = ()

    @classmethod
    def of(cls, vllm_config: Any, kv_groups: tuple[str, ...] = ()) -> Compat:
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        cache = vllm_config.cache_config
        hf = getattr(model, "hf_config", None)
        architectures = getattr(hf, "architectures", None) or [""]
        served = getattr(model, "served_model_name", None) or model.model
        if isinstance(served, list | tuple):
            served = served[0]
        return cls(
            model=str(served), architecture=str(architectures[0]),
            num_layers=int(model.get_total_num_hidden_layers()),
            num_kv_heads=int(model.get_total_num_kv_heads()),
            head_size=int(model.get_head_size()),
            use_mla=bool(getattr(model, "use_mla", False)),
            dtype=str(model.dtype).removeprefix("torch."),
            cache_dtype=str(cache.cache_dtype), block_size=int(cache.block_size),
            tensor_parallel_size=int(parallel.tensor_parallel_size),
            pipeline_parallel_size=int(parallel.pipeline_parallel_size),
            kvd_protocol=PROTOCOL_VERSION, connector=CONNECTOR_VERSION, kv_groups=kv_groups)

    @classmethod
    def from_params(cls, value: Any) -> Compat | None:
        """Prefill's, as its params carry it (they come through a proxy: checked field by
        field); None when they carry none."""
        if value is None:
            return None
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"kvd_compat: {exc}") from None

    def as_params(self) -> dict[str, Any]:
        params: dict[str, Any] = msgspec.to_builtins(self)
        return params

    def refusal(self, theirs: Compat) -> str:
        """Why a prefill engine's KV (``theirs``) does not fit this engine: each field that
        differs and must not, as ``name: prefill …, this engine …``; '' if none does.
        Tensor-parallel sizes may differ where one divides the other (and both split the
        KV heads evenly: vLLM starts no engine that does not)."""
        why = [f"{name}: prefill {getattr(theirs, name)!r}, this engine "
               f"{getattr(self, name)!r}" for name in self.__struct_fields__
               if name not in _MAY_DIFFER and getattr(self, name) != getattr(theirs, name)]
        ours, other = self.tensor_parallel_size, theirs.tensor_parallel_size
        if not why and ours != other:
            try:
                if STATE in self.kv_groups:
                    raise BadRequest("a hybrid model's recurrent (Mamba) state is cut over "
                                     "the ranks by the model's own heads, which kvd does not "
                                     "cut again: run both with the same size")
                check_pair(ours, other, 1 if self.use_mla else self.num_kv_heads)
            except BadRequest as err:
                why.append(f"tensor_parallel_size: prefill {other}, this engine {ours} "
                           f"({err.message})")
        return "; ".join(why)
