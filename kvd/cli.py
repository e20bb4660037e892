"""The ``kvd`` command: ``serve``, ``demo``, ``stats``, ``ping``, ``keygen``, ``--version``.

Errors are one line on stderr and a non-zero exit: 2 for bad configuration or usage,
1 for a failed operation.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

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
    from kvd.daemon.service import run

    config = config_from_args(args)
    _setup_logging(config.log_level)
    return run(config)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvd.demo import run_demo

    return run_demo(args)


def _client_socket(args: argparse.Namespace) -> str:
    return str(config_from_args(args, check_paths=False).socket_path)


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvd.client import KvdClient

    with KvdClient(_client_socket(args), name="kvd-cli", timeout_s=args.timeout) as client:
        stats = client.stats()
    print(json.dumps(stats, indent=None if args.json else 2, sort_keys=True))
    return 0


def _cmd_ping(args: argparse.Namespace) -> int:
    from kvd.client import KvdClient

    with KvdClient(_client_socket(args), name="kvd-cli", timeout_s=args.timeout) as client:
        rtt = client.ping()
        node, epoch = client.node_id, client.epoch
    if args.json:
        print(json.dumps({"node_id": node, "epoch": epoch, "rtt_s": rtt}))
    else:
        print(f"kvd daemon {node} (epoch {epoch}) answered in {rtt * 1e6:.0f} µs")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from kvd.daemon.auth import write_keys

    public_file, secret_file, public = write_keys(args.dir, args.name)
    print(f"public key:  {public_file}\nsecret key:  {secret_file} (mode 0600)")
    print("this daemon's config:")
    print(f'  curve_secret_key_file = "{secret_file}"')
    print("line for the allow-list (curve_allowed_keys_file) of every peer:")
    print(f"  {public} <this daemon's host:peer_port>")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="KV-cache transfer daemon")
    parser.add_argument("--version", action="version",
                        version=f"kvd {__version__} (protocol {PROTOCOL_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
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
    keygen.add_argument("--dir", default=".", help="where to write NAME.key[_secret]")
    keygen.add_argument("--name", default="kvd", help="file name stem")
    keygen.set_defaults(func=_cmd_keygen)

    for name, func, help_text in (
        ("stats", _cmd_stats, "print the daemon's counters as JSON"),
        ("ping", _cmd_ping, "check that the daemon answers"),
    ):
        p = sub.add_parser(name, help=help_text)
        add_config_arguments(p)
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
        p.add_argument("--json", action="store_true", help="one line of JSON")
        p.set_defaults(func=func)
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
