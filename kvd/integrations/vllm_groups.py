"""vLLM's KV cache groups (``KVCacheConfig``), read into ``kv_groups.Group``.

The connector moves the groups that vLLM marks for transfer (``transfer_groups``), in
their order; each kind of spec it knows becomes a group kind, and one it does not know
stops the engine at start, naming it, rather than move bytes it cannot place. Apart
from the connector so that the rest of the group arithmetic (``kv_groups``) reads
without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvd.errors import BadRequest
from kvd.integrations.kv_groups import FULL, SLIDING, STATE, Group


@dataclass(frozen=True)
class Layout:
    """The groups a connector moves: ``groups[i]`` is vLLM's group ``ids[i]``, with the
    layers ``layers[i]``; vLLM has ``count`` groups in all (some may not be moved)."""

    groups: list[Group]
    ids: list[int]
    layers: list[list[str]] = field(default_factory=list)
    count: int = 1

    @property
    def names(self) -> tuple[str, ...]:
        """What ``kvd_compat`` carries: () for the one full-attention group of a model
        that is not hybrid (what a connector before groups sent, too)."""
        if [g.kind for g in self.groups] == [FULL]:
            return ()
        return tuple(g.name for g in self.groups)


def layout_of(kv_cache_config: Any, block_size: int) -> Layout:
    """The groups of ``kv_cache_config`` that vLLM transfers, as the connector moves
    them; ``BadRequest`` for a kind it cannot move or a block size other than
    ``block_size`` (the engine's)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if kv_cache_config is None:
        return Layout([Group(FULL, block_size)], [0])  # one full-attention group
    all_groups = list(kv_cache_config.kv_cache_groups)
    ids = list(getattr(kv_cache_config, "transfer_group_ids", range(len(all_groups))))
    groups: list[Group] = []
    for gid in ids:
        spec = all_groups[gid].kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):  # one type, a spec per layer
            spec = next(iter(spec.kv_cache_specs.values()))
        kind = type(spec)
        if kind in (FullAttentionSpec, MLAAttentionSpec):
            group = Group(FULL, spec.block_size)
        elif kind is SlidingWindowSpec:
            # vLLM keeps extra_retained_tokens more behind the window (spec decoding).
            group = Group(SLIDING, spec.block_size,
                          window=spec.sliding_window + spec.extra_retained_tokens)
        elif kind is MambaSpec:
            group = Group(STATE, spec.block_size, scratch_blocks=spec.num_speculative_blocks)
        else:
            raise BadRequest(f"KvdConnector cannot move KV cache group {gid} "
                             f"({kind.__name__}, layers {all_groups[gid].layer_names[:3]}...) "
                             "yet: full attention, sliding window and Mamba state only")
        if group.block_size != block_size:
            raise BadRequest(f"KV cache group {gid} has blocks of {group.block_size} tokens, "
                             f"the engine {block_size}: KvdConnector needs one block size")
        groups.append(group)
    if not groups:
        raise BadRequest("the model has no KV cache group to transfer")
    return Layout(groups, ids, [list(all_groups[gid].layer_names) for gid in ids],
                  len(all_groups))
