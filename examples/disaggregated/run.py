"""Disaggregated prefill/decode over kvd, checked token for token against one process.

    python examples/disaggregated/run.py [--requests 3] [--max-tokens 16]
                                         [--prefill-workers 1] [--decode-workers 1]

Creates a small Llama (fixed random weights) in a temporary directory, starts two kvd
daemons, a prefill worker on the first and a decode worker on the second, and the proxy;
sends requests (prompts of different lengths, then two at once) and compares every answer
with greedy generation of the same model in this process. Exit code 1 on any difference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
import transformers
from cluster import Cluster, daemon_stats
from model import create_model, generate_single_process, load_model
from paged_kv import BLOCK_SIZE, blocks_needed

PROMPT_LENGTHS = (7, 40, 23, 64, 90, 5)  # cycled for --requests; most span several blocks
PAIR_LENGTHS = (17, 33)  # the concurrent pair


def make_prompt(length: int, seed: int, vocab_size: int = 1000) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


async def complete(session: aiohttp.ClientSession, proxy_url: str, prompt: Sequence[int],
                   max_tokens: int, timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions; (HTTP status, JSON body)."""
    async with session.post(f"{proxy_url}/v1/completions",
                            json={"prompt_token_ids": list(prompt), "max_tokens": max_tokens},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, await r.json(content_type=None)


async def complete_all(proxy_url: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                       concurrently: bool = False) -> list[tuple[int, dict[str, Any]]]:
    async with aiohttp.ClientSession() as session:
        if concurrently:
            return list(await asyncio.gather(
                *(complete(session, proxy_url, p, max_tokens) for p in prompts)))
        return [await complete(session, proxy_url, p, max_tokens) for p in prompts]


@dataclass
class Outcome:
    label: str
    prompt: list[int]
    status: int
    body: dict[str, Any]
    reference: list[int]

    @property
    def identical(self) -> bool:
        return self.status == 200 and self.body["tokens"] == self.reference

    def report(self) -> str:
        n = len(self.prompt)
        lines = [f"{self.label}: {n} prompt tokens ({blocks_needed(n)} block"
                 f"{'s' if blocks_needed(n) > 1 else ''} of {BLOCK_SIZE})"]
        if self.status != 200:
            lines.append(f"  FAILED: HTTP {self.status}: {self.body.get('error')}")
            lines.append(f"  single-process: {self.reference}")
            return "\n".join(lines)
        b = self.body
        lines[0] += f", prefill {b['prefill']} -> decode {b['decode']}"
        lines.append(f"  disaggregated : {b['tokens']}")
        lines.append(f"  single-process: {self.reference}")
        lines.append(f"  {'identical' if self.identical else 'DIFFERENT'}; KV "
                     f"{b['kv_bytes']:,} bytes moved in {b['kv_move_s'] * 1e3:.1f} ms "
                     f"(decode's get waited {b['get_s'] * 1e3:.1f} ms)")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3,
                   help="requests sent one after another (then one concurrent pair)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--device", default="cpu",
                   help="where the workers run the model (KV blocks stay in CPU shared "
                        "memory; GPU-to-GPU needs kvd's GPU transport, not there yet)")
    p.add_argument("--kv-timeout-s", type=float, default=5.0,
                   help="how long a decode worker waits for a request's KV")
    p.add_argument("--prefill-workers", type=int, default=1, help="on daemon p1")
    p.add_argument("--decode-workers", type=int, default=1, help="on daemon p2")
    args = p.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()

    root = tempfile.mkdtemp(prefix="kvd-dis-", dir="/tmp")
    outcomes: list[Outcome] = []
    try:
        model_dir = os.path.join(root, "model")
        create_model(model_dir)
        reference_model = load_model(model_dir, args.device)
        print(f"model: Llama, 4 layers, 2 KV heads x 32, float32, seed 0, saved to {model_dir}")
        started = time.monotonic()
        with Cluster(root, model_dir, device=args.device, kv_timeout_s=args.kv_timeout_s,
                     prefill_workers=args.prefill_workers,
                     decode_workers=args.decode_workers) as cluster:
            p1, p2 = cluster.daemons
            print(f"kvd daemons: p1 {p1.peer_address}, p2 {p2.peer_address}")
            for w in cluster.workers:
                print(f"{w.kind} worker {w.url} on daemon {w.daemon.peer_address}")
            print(f"proxy {cluster.proxy_url} (all up in {time.monotonic() - started:.1f} s)")
            print()
            prompts = [make_prompt(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], seed=i)
                       for i in range(args.requests)]
            pair = [make_prompt(n, seed=100 + i) for i, n in enumerate(PAIR_LENGTHS)]
            answers = asyncio.run(complete_all(cluster.proxy_url, prompts, args.max_tokens))
            answers += asyncio.run(complete_all(cluster.proxy_url, pair, args.max_tokens,
                                                concurrently=True))
            labels = [f"request {i + 1}" for i in range(len(prompts))]
            labels += [f"concurrent {chr(ord('a') + i)}" for i in range(len(pair))]
            for label, prompt, (status, body) in zip(labels, prompts + pair, answers,
                                                     strict=True):
                reference = generate_single_process(reference_model, prompt, args.max_tokens)
                outcomes.append(Outcome(label, prompt, status, body, reference))
                print(outcomes[-1].report())
            sent, received = daemon_stats(p1)["transfers"], daemon_stats(p2)
            print(f"kvd p1 sent {sent['sent'].get('done', 0)} transfers, "
                  f"{sent['bytes_sent']:,} bytes; p2 received "
                  f"{received['transfers']['received'].get('done', 0)}, "
                  f"{received['transfers']['bytes_received']:,} bytes, holds "
                  f"{received['keys']} keys, pool in use {received['pool']['used_bytes']} bytes")
            codes = cluster.close()
        print()
        print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bad = [o.label for o in outcomes if not o.identical]
    if bad:
        print(f"FAILED: {', '.join(bad)} differ from single-process generation")
        return 1
    print(f"all {len(outcomes)} requests: tokens identical to single-process greedy generation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
