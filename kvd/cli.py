"""The ``kvd`` command: ``serve``, ``status``, ``peers``, ``drain``, ``bench``, ``demo``,
``keygen``, ``stats``, ``ping``, ``--version``.

Errors are one line on stderr and a non-zero exit: 2 for bad configuration or usage,
1 for a failed operation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvd import __version__
from kvd.config import add_config_arguments, config_from_args
from kvd.errors import ConfigError, KvdError
from kvd.protocol import PROTOCOL_VERSION


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # a bad config fails before the second it takes to
    _setup_logging(config.log_level)  # import the daemon (torch)
    from kvd.daemon.service import run

    code = run(config)
    # Stopped: every resource went with the daemon's exit stack. The interpreter's own
    # teardown after that (torch's finalizers: 0.3 s of a 2-core machine's CPU) frees only
    # what the kernel frees anyway, so skip it; and no thread left behind can hold the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvd.demo import run_demo

    return run_demo(args)


def _client_socket(args: argparse.Namespace) -> str:
    return str(config_from_args(args, check_paths=False).socket_path)


def _client(args: argparse.Namespace) -> Any:
    from kvd.client import KvdClient

    return KvdClient(_client_socket(args), name="kvd-cli", timeout_s=args.timeout)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True))


def _cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    print(json.dumps(stats, indent=None if args.json else 2, sort_keys=True))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        st = client.stats()
    if args.json:
        _print_json(st)
        return 0
    pool, peer, xfer = st["pool"], st.get("peer", {}), st.get("transfers", {})
    rows = [
        ("node", f"{st['node_id']} (epoch {st['epoch']})"),
        ("ready", "yes" if st.get("ready") else "no" + (" (draining)" if st["draining"] else "")),
        ("local socket", _client_socket(args)),
        ("peer address", f"{peer.get('address', '-')} (data port {peer.get('data_port', '-')})"),
        ("http", st.get("http") or "-"),
        ("clients", st["clients"]),
        ("regions", st["regions"]),
        ("keys", f"{st['keys']} ({_size(st['keys_pool_bytes'])} in the pool), "
                 f"{st['expired_keys']} expired"),
        ("waiting gets", st["waiting_gets"]),
        ("host pool", f"{_size(pool['used_bytes'])} used of {_size(pool['capacity_bytes'])}, "
                      f"largest free {_size(pool['largest_free_bytes'])}"),
        ("in flight", f"{st['in_flight']} requests, {xfer.get('in_flight_out', 0)} out, "
                      f"{xfer.get('in_flight_in', 0)} in"),
        ("peers", f"{len(peer.get('links', []))} linked"),
        ("transfers sent", _outcomes(xfer.get("sent", {}))),
        ("transfers received", _outcomes(xfer.get("received", {}))),
        ("bad messages", _outcomes({**{f"local/{k}": v for k, v in st["bad_messages"].items()},
                                    **{f"peer/{k}": v for k, v in
                                       peer.get("bad_messages", {}).items()}})),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _cmd_peers(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    peer = stats.get("peer", {})
    links = peer.get("links", [])
    nccl = (stats.get("transfers") or {}).get("nccl") or {}
    for link in links:  # NCCL channels live beside the link: count them per peer
        link["nccl_channels"] = [c for c in nccl.get("channels", [])
                                 if c["peer"] == link["address"]]
    if args.json:
        _print_json(links)
        return 0
    if not links:
        print(f"no peers linked (this daemon: {peer.get('address', '-')})")
        return 0
    header = ("ADDRESS", "NODE", "EPOCH", "DIR", "LAST HEARD", "GPUS", "CHANNELS")
    table = [header] + [
        (link["address"], link["node_id"], str(link["epoch"]), link["direction"],
         f"{link['last_heard_s_ago']:.1f}s ago",
         str(sum(1 for d in link.get("devices", []) if d.startswith("cuda"))),
         ",".join([*(f"tcp-{k}" for k, v in link.get("channels", {}).items() if v),
                   *(f"nccl-{c['direction']}-{c['device']}:{c['peer_device']}"
                     for c in link["nccl_channels"])]) or "-")
        for link in links]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _cmd_drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        report = client.drain(grace_s=args.grace, timeout_s=(args.grace or 3600) + 30)
    if args.json:
        _print_json(report)
    else:
        print(f"drained in {report['waited_s']:.2f}s: {report['finished']} of "
              f"{report['in_flight_at_start']} in-flight requests finished, "
              f"{report['cancelled']} cancelled at the grace, "
              f"{report['gets_refused']} waiting gets refused; the daemon is exiting")
    return 0 if report["cancelled"] == 0 else 1


def _cmd_ping(args: argparse.Namespace) -> int:
    with _client(args) as client:
        rtt = client.ping()
        node, epoch = client.node_id, client.epoch
    if args.json:
        _print_json({"node_id": node, "epoch": epoch, "rtt_s": rtt})
    else:
        print(f"kvd daemon {node} (epoch {epoch}) answered in {rtt * 1e6:.0f} µs")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvd.bench import run_bench

    return run_bench(args, _client(args))


def _size(n: int) -> str:
    from kvd.config import format_size

    return format_size(int(n)) if n else "0"


def _outcomes(table: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(table.items())) or "-"


def _cmd_keygen(args: argparse.Namespace) -> int:
    from kvd.daemon.auth import write_keys

    public_file, secret_file, public = write_keys(args.dir, args.name)
    print(f"public key: {public_file}\nsecret key: {secret_file} (mode 0600)")
    print("this daemon's config:")
    print(f'  curve_secret_key_file = "{secret_file}"')
    print('  curve_allowed_keys_file = "<the allow-list: one line per daemon>"')
    print("add this line to the allow-list (one file can serve every daemon; put this "
          "daemon's peer host:port):")
    print(f"{public} HOST:PORT")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache transfer daemon")
    parser.add_argument("--version", action="version",
                        version=f"kvd {__version__} (protocol {PROTOCOL_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the daemon in the foreground",
        description="Run the kvd daemon in the foreground. Its settings are the flags below, "
                    "the same keys in a TOML file (--config) or KVD_<KEY> variables; "
                    "docs/operations.md explains each.")
    add_config_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    demo = sub.add_parser(
        "demo", help="start a daemon, move blocks between two clients, check the bytes"
    )
    demo.add_argument("--blocks", type=int, default=64, help="blocks in each region")
    demo.add_argument("--block-kib", type=int, default=64, help="KiB per block per tensor")
    demo.add_argument("--layers", type=int, default=4, help="tensors in each region")
    demo.set_defaults(func=_cmd_demo)

    keygen = sub.add_parser("keygen", help="create a CurveZMQ key pair for the peer plane")
    keygen.add_argument("--dir", default=".", help="where to write NAME.key and NAME.key_secret")
    keygen.add_argument("--name", default="kvd", help="file name stem")
    keygen.set_defaults(func=_cmd_keygen)

    for name, func, help_text in (
        ("status", _cmd_status, "what the daemon is doing, as a table"),
        ("peers", _cmd_peers, "the peer daemons this one is linked to"),
        ("stats", _cmd_stats, "the daemon's counters as JSON"),
        ("ping", _cmd_ping, "check that the daemon answers"),
        ("drain", _cmd_drain, "stop taking work, finish in-flight work, exit; report"),
        ("bench", _cmd_bench, "move data to a peer and back; throughput and latency"),
    ):
        p = sub.add_parser(name, help=help_text)
        add_config_arguments(p)
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
        p.add_argument("--json", action="store_true", help="one line of JSON")
        p.set_defaults(func=func)
        if name == "drain":
            p.add_argument("--grace", type=float, default=None,
                           help="seconds in-flight work may take (default: drain_grace_s)")
        if name == "bench":
            p.add_argument("--to", required=True, help="peer daemon host:port")
            p.add_argument("--size", default="256MiB", help="bytes per transfer (e.g. 1GiB)")
            p.add_argument("--blocks", type=int, default=16, help="blocks per transfer")
            p.add_argument("--repeat", type=int, default=5, help="transfers each way")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvd: config error: {exc}", file=sys.stderr)
        return 2
    except KvdError as exc:
        print(f"kvd: {exc.code}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
