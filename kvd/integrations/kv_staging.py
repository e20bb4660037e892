"""The block arithmetic of staging: which tensor dimension holds blocks, how a block copy is
made wide, and which staging slots are free.

Staging is the mover's shared memory for blocks the daemon cannot read in place (a CPU
engine's private tensors, a part sent while its request still runs, a load that skips a
cached prefix). ``KvMover`` owns the staging region and its life with the daemon; this
module holds the parts of it that need no daemon, so that they read (and test) alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvd.client.shm import shared_empty
from kvd.errors import BadRequest
from kvd.protocol import Part


def block_dim_of(tensor: torch.Tensor, num_blocks: int) -> int:
    """Which dimension indexes blocks: the first one of size ``num_blocks``."""
    for dim, size in enumerate(tensor.shape[:2]):
        if size == num_blocks:
            return dim
    raise BadRequest(f"KV tensor of shape {tuple(tensor.shape)} has no dimension of "
                     f"{num_blocks} blocks among its first two")


def blocks_like(layers: Sequence[torch.Tensor], n: int, on_gpu: bool) -> list[torch.Tensor]:
    """``n`` blocks shaped like one block of each (block-major) layer, in memory the daemon
    can map: the same GPU for GPU tensors, shared memory for CPU ones."""
    if on_gpu:
        return [torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
                for t in layers]
    return [shared_empty((n, *t.shape[1:]), t.dtype) for t in layers]


def wide_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (blocks first) as [blocks, words] of the widest integer its block bytes allow,
    when each block is one contiguous run: a block copy then moves 8 bytes per element
    instead of 2 (about twice as fast for bf16 on CPU). Otherwise ``t`` itself."""
    try:
        flat = t.view(t.shape[0], -1)
    except RuntimeError:
        return t  # a block is not one run (e.g. K and V apart): copy it as it is
    nbytes = flat.shape[1] * flat.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if nbytes % dtype.itemsize == 0 and flat.stride(-1) == 1:
            try:
                return flat.view(dtype)
            except RuntimeError:
                continue
    return t


def wide_pair(layer: torch.Tensor, stage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer and its staging, both widened alike, or both as they are."""
    wide_layer, wide_stage = wide_view(layer), wide_view(stage)
    if wide_layer.dtype == wide_stage.dtype and wide_layer.dim() == wide_stage.dim() == 2:
        return wide_layer, wide_stage
    return layer, stage


def part_pair(layer: torch.Tensor, stage: torch.Tensor, part: Part,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``part`` of each block of a layer and of its staging (as the daemon cuts a block:
    ``kvd.memory.regions.part_of_blocks``), for copying only that part."""
    views = []
    for t in (layer, stage):
        try:
            flat = t.view(t.shape[0], -1)
        except RuntimeError:
            raise BadRequest(f"KV blocks of shape {tuple(t.shape[1:])} are not one "
                             "contiguous run each: they cannot be cut in parts") from None
        size, rest = divmod(flat.shape[1], part.count)
        if rest:
            raise BadRequest(f"KV blocks of {flat.shape[1]} elements do not cut in "
                             f"{part.count} parts")
        views.append(flat[:, part.index * size:(part.index + 1) * size])
    return views[0], views[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes (torch has no CPU index_copy_ for one-byte floats)."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def copy_blocks(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int],
                slots: Sequence[int], inward: bool) -> None:
    """Engine blocks into staging slots (``inward``), or staging slots into blocks, in every
    (layer, staging) pair."""
    device = pairs[0][0].device
    blocks = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    staged = torch.tensor(list(slots), dtype=torch.long, device=device)
    for layer, stage in ((_bits(x), _bits(y)) for x, y in pairs):
        if inward:
            stage.index_copy_(0, staged, layer.index_select(0, blocks))
        else:
            layer.index_copy_(0, blocks, stage.index_select(0, staged))


class Slots:
    """Which staging slots are free (first fit, lowest first)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give(self, slots: Sequence[int]) -> None:
        self._free = sorted([*self._free, *slots])

    @property
    def free(self) -> int:
        return len(self._free)
