"""A paged KV cache like an inference engine's, in memory the kvd daemon can map.

Per layer, K and V are ``[num_blocks, block_size, kv_heads, head_dim]``; token ``t`` of a
request lives in its block ``t // block_size``, slot ``t % block_size``. One more per-block
tensor, ``meta`` (``[num_blocks, block_size]`` int64), travels with the KV: prefill writes
the first generated token into slot 0 of the request's first block and the prompt length
into slot 1. All ``2 * layers + 1`` tensors are one kvd region (block dimension 0), so one
``put``/``get`` of a request's blocks moves its KV and its meta together.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import kvd

BLOCK_SIZE = 16
NUM_BLOCKS = 64
META_FIRST_TOKEN, META_PROMPT_LEN = 0, 1


def blocks_needed(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


class OutOfBlocks(Exception):
    pass


class BlockAllocator:
    """A free list of block ids; ``with allocator.hold(n) as blocks:`` frees them on exit,
    errors included."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} of "
                              f"{self.num_blocks} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[list[int]]:
        blocks = self.alloc(n)
        try:
            yield blocks
        finally:
            self.free(blocks)


class PagedKV:
    """The worker's KV blocks (CPU shared memory) and the copies between them and a
    model's per-layer K/V tensors ``[1, kv_heads, tokens, head_dim]`` (on any device)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int,
                 num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [kvd.shared_zeros(shape, dtype) for _ in range(num_layers)]
        self.v = [kvd.shared_zeros(shape, dtype) for _ in range(num_layers)]
        self.meta = kvd.shared_zeros((num_blocks, block_size), torch.int64)

    @classmethod
    def for_model(cls, model: Any, num_blocks: int = NUM_BLOCKS) -> PagedKV:
        c = model.config
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                   num_blocks=num_blocks, dtype=model.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """The region, in order: K0, V0, K1, V1, …, meta."""
        out = [t for pair in zip(self.k, self.v, strict=True) for t in pair]
        return [*out, self.meta]

    async def register(self, client: kvd.AsyncKvdClient) -> kvd.Region:
        return await client.register("kv-cache", self.tensors(), block_dim=0)

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    def write(self, blocks: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
              first_token: int) -> None:
        """Copy a prompt's K/V into ``blocks`` (token t -> block t // bs, slot t % bs) and
        the first generated token and prompt length into ``meta``."""
        idx = torch.tensor(blocks, dtype=torch.long)
        num_tokens = kv[0][0].shape[2]
        assert blocks_needed(num_tokens, self.block_size) == len(blocks)
        for dst, src in ((self.k, [k for k, _ in kv]), (self.v, [v for _, v in kv])):
            for layer, t in zip(dst, src, strict=True):
                tokens = t[0].transpose(0, 1).to("cpu")  # [tokens, kv_heads, head_dim]
                padded = tokens.new_zeros((len(blocks) * self.block_size, *tokens.shape[1:]))
                padded[:num_tokens] = tokens
                layer.index_copy_(0, idx, padded.view(len(blocks), self.block_size,
                                                      *tokens.shape[1:]))
        self.meta[blocks].zero_()
        self.meta[blocks[0], META_FIRST_TOKEN] = first_token
        self.meta[blocks[0], META_PROMPT_LEN] = num_tokens

    def read(self, blocks: Sequence[int], num_tokens: int,
             device: str | torch.device = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``num_tokens`` tokens' K/V from ``blocks``, per layer, as
        ``[1, kv_heads, num_tokens, head_dim]`` copies on ``device``."""
        idx = torch.tensor(blocks, dtype=torch.long)

        def gather(layer: torch.Tensor) -> torch.Tensor:
            flat = layer.index_select(0, idx).flatten(0, 1)[:num_tokens]
            return flat.transpose(0, 1).unsqueeze(0).contiguous().to(device)

        return [(gather(k), gather(v)) for k, v in zip(self.k, self.v, strict=True)]

    def read_meta(self, blocks: Sequence[int]) -> tuple[int, int]:
        """(first token, prompt length) as prefill wrote them."""
        row = self.meta[blocks[0]]
        return int(row[META_FIRST_TOKEN]), int(row[META_PROMPT_LEN])
