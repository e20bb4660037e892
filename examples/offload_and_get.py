"""The smallest use of kvd: offload KV blocks to the daemon's host pool, get them back.

Start a daemon first (`kvd serve`), then run `python examples/offload_and_get.py`. The
client finds the daemon at ``$KVD_SOCKET_PATH``, else at kvd's default socket path.
"""

from __future__ import annotations

import sys

import torch

import kvd


def main() -> int:
    client = kvd.KvdClient(name="example")
    try:
        client.connect()
    except kvd.DaemonUnavailable:
        print(f"no kvd daemon at {client.socket_path}: start one with "
              f"`kvd serve --socket-path {client.socket_path}`", file=sys.stderr)
        return 1
    try:
        offload_and_get(client)
    finally:
        client.close()
    return 0


def offload_and_get(client: kvd.KvdClient) -> None:
    num_blocks, block_tokens, kv_heads, head_dim = 64, 16, 8, 128
    # KV tensors must live in shared memory the daemon can map: allocate them with kvd.
    layers = [kvd.shared_zeros((num_blocks, block_tokens, kv_heads, head_dim),
                               torch.bfloat16) for _ in range(4)]
    for layer in layers:
        layer.normal_()
    region = client.register("kv-cache", layers)  # once per process

    stored = client.offload("prefix-42", region, blocks=[0, 1, 2, 3], ttl_s=600)
    expected = [layer[:4].clone() for layer in layers]
    for layer in layers:
        layer[:4].zero_()  # the engine reuses those blocks

    client.get("prefix-42", region, blocks=[10, 11, 12, 13], timeout_s=5)
    for layer, exp in zip(layers, expected, strict=True):
        assert torch.equal(layer[10:14], exp)
    print(f"offloaded {stored / 2**20:.1f} MiB and got it back into other blocks")
    client.delete("prefix-42")


if __name__ == "__main__":
    sys.exit(main())
