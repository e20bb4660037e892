"""A KV cache group's tensors with the daemon: registered in place (GPU), or through a
*staging* region of shared memory (CPU: an engine's private tensors, which the daemon
cannot map), with the block arithmetic and copies of staging and which of its slots are
free. Staging also carries a part sent while its request still runs (the engine may reuse
its blocks before the send ends) and a load into only a part of each block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvd.client.shm import shared_empty
from kvd.client.sync import KvdClient
from kvd.errors import BadRequest
from kvd.protocol import WHOLE, Part


def block_dim_of(tensor: torch.Tensor, num_blocks: int) -> int:
    """Which dimension indexes blocks: the first one of size ``num_blocks``."""
    for dim, size in enumerate(tensor.shape[:2]):
        if size == num_blocks:
            return dim
    raise BadRequest(f"KV tensor of shape {tuple(tensor.shape)} has no dimension of "
                     f"{num_blocks} blocks among its first two")


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


class Registration:
    """One KV cache group's layers, registered by a client of its own (a hybrid model's
    groups lie over one allocation: one client would register the same bytes twice)."""

    def __init__(self, client: KvdClient, layers: Sequence[torch.Tensor], num_blocks: int,
                 staging_blocks: int, name: str) -> None:
        if not layers:
            raise BadRequest("no KV tensors to register")
        self.client = client
        self.block_dims = [block_dim_of(t, num_blocks) for t in layers]
        # Block-major views: index 0 picks a block, in every layer.
        self.layers = [t.movedim(d, 0) if d else t for t, d in zip(layers, self.block_dims,
                                                                   strict=True)]
        self.direct = all(t.is_cuda for t in layers)
        if not self.direct and any(t.is_cuda for t in layers):
            raise BadRequest("KV tensors are on both CPU and GPU")
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.layers)
        if self.direct and len(set(self.block_dims)) != 1:
            raise BadRequest(f"KV tensors have their blocks on different dims {self.block_dims}")
        self._tensors = list(layers)
        self._name = name
        self._staging_blocks = staging_blocks
        self.region: Any = None
        self.register()

    def register(self) -> None:
        """Register with the client's daemon. Staging is made anew each time (memory an old
        daemon may still hold is not reused)."""
        self._staging: list[torch.Tensor] | None = None
        self.staging_region: Any = None
        self.slots = Slots(0)
        if self.direct:
            self.region = self.client.register(self._name, self._tensors,
                                               block_dim=self.block_dims[0])
        else:
            self._make_staging()

    def _make_staging(self) -> None:
        n = self._staging_blocks
        if n <= 0:
            raise BadRequest("staging_blocks must be positive for CPU KV tensors")
        # n blocks like each layer's, in memory the daemon can map: the same GPU for GPU
        # tensors (staged for a part sent early, or read in part), shared memory for CPU.
        tensors = [torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
                   if self.direct else shared_empty((n, *t.shape[1:]), t.dtype)
                   for t in self.layers]
        self._staging = tensors
        self.staging_region = self.client.register("kv-staging", tensors)
        self._part_pairs: dict[Part, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._wide_pairs = [wide_pair(t, st) for t, st in zip(self.layers, tensors,
                                                              strict=True)]
        self.slots = Slots(n)

    def take_slots(self, n: int) -> list[int] | None:
        """``n`` staging slots, or None while staging is full."""
        if self._staging is None:
            self._make_staging()
        if n > self.slots.count:
            raise BadRequest(f"{n} blocks do not fit in {self.slots.count} staging blocks "
                             "(raise staging_blocks)")
        return self.slots.take(n)

    def stage(self, block_ids: Sequence[int], slots: Sequence[int], inward: bool,
              part: Part = WHOLE) -> None:
        """Engine blocks into staging slots (``inward``), or staging slots into blocks
        (only ``part`` of each)."""
        pairs = self._wide_pairs
        if part != WHOLE:
            if part not in self._part_pairs:
                assert self._staging is not None
                self._part_pairs[part] = [part_pair(t, st, part) for t, st in
                                          zip(self.layers, self._staging, strict=True)]
            pairs = self._part_pairs[part]
        device = pairs[0][0].device
        blocks = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        staged = torch.tensor(list(slots), dtype=torch.long, device=device)
        for layer, stage in ((_bits(x), _bits(y)) for x, y in pairs):
            if inward:
                stage.index_copy_(0, staged, layer.index_select(0, blocks))
            else:
                layer.index_copy_(0, blocks, stage.index_select(0, staged))
