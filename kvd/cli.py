"""The ``kvd`` command: ``serve``, ``status``, ``peers``, ``drain``, ``reload``, ``bench``,
``demo``, ``keygen``, ``stats``, ``ping``, ``--version``.

Each command takes only its own options: ``serve`` the daemon's settings; the client
commands (``ping``, ``stats``, ``status``, ``peers``, ``drain``, ``reload``, ``bench``) where
the daemon is (``--socket-path``, read from nowhere else but ``KVD_SOCKET_PATH`` and the
config file's ``socket_path``), how long to wait, ``--json``, and their own. No option may be
abbreviated.

Errors are one line on stderr and a non-zero exit: 2 for bad configuration or usage,
1 for a failed operation. Under ``--json`` (the client commands and ``keygen``) an error is
one line of JSON on stdout instead, ``{"error": {"code": ..., "message": ...}}``, with the
same exit code.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvd import __version__
from kvd.config import (
    OPERATOR_SETTINGS,
    add_config_arguments,
    client_socket_path,
    config_from_args,
    format_size,
    parse_size,
    settings_from_args,
)
from kvd.errors import ConfigError, KvdError
from kvd.protocol import CLI_CLIENT_NAME, PROTOCOL_VERSION

# Where `kvd keygen` writes without --dir: the directory the systemd unit and the sample
# config (systemd/kvd.toml) read the node's keys from.
DEFAULT_KEY_DIR = "/etc/kvd"


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvd.daemon.notify import StartupSteps

    began = time.monotonic()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,  # (reading the config warns)
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.check:
        return _check_settings(args)
    config = config_from_args(args)  # a bad config fails before the second it takes to
    logging.getLogger().setLevel(config.log_level.upper())  # import the daemon (torch)
    steps = StartupSteps()
    steps.done("config read", began)
    began = time.monotonic()
    from kvd.daemon.service import run

    steps.done("imports done", began)
    code = run(config)
    # Stopped: every resource went with the daemon's exit stack. The interpreter's own
    # teardown after that (torch's finalizers: 0.3 s of a 2-core machine's CPU) frees only
    # what the kernel frees anyway, so skip it; and no thread left behind can hold the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_settings(args: argparse.Namespace) -> int:
    """``kvd serve --check``: each setting as a config-file line, with where it came from."""
    from kvd.daemon.auth import check_exposure

    config, sources = settings_from_args(args, check_paths=False)
    check_exposure(config)
    for name, value in config.as_dict().items():
        if name in OPERATOR_SETTINGS or name in sources:  # (KVD_DEV's too)
            shown = json.dumps(value)
            if name.endswith("_bytes") and parse_size(format_size(value)) == value:
                shown = json.dumps(format_size(value))  # ("1GiB", where it is exact)
            print(f"{name} = {shown}  # {sources.get(name, 'default')}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvd.demo import run_demo

    return run_demo(args)


def _client_socket(args: argparse.Namespace) -> str:
    return client_socket_path(args.socket_path, args.config)


def _client(args: argparse.Namespace) -> Any:
    from kvd.client import KvdClient

    return KvdClient(_client_socket(args), name=CLI_CLIENT_NAME, timeout_s=args.timeout)


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
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(st["started_at"]))
    rows = [
        ("node", f"{st['node_id']} (epoch {st['epoch']})"),
        ("version", f"kvd {st['version']}"),
        ("up", f"{_duration(st['uptime_s'])}, since {started}"),
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


def _cmd_reload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        report = client.reload()
    if args.json:
        _print_json(report)
    else:
        print(f"allow-list reloaded: {report['allowed_keys']} keys; added "
              f"{', '.join(report['added']) or 'none'}; removed "
              f"{', '.join(report['removed']) or 'none'}; links ended "
              f"{', '.join(report['links_ended']) or 'none'}")
    return 0


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
    return format_size(int(n)) if n else "0"


def _duration(seconds: float) -> str:
    """``2d 3h``, ``5m 12s``, ``7s``: the two largest units."""
    s = int(seconds)
    units = [(s // 86400, "d"), (s // 3600 % 24, "h"), (s // 60 % 60, "m"), (s % 60, "s")]
    first = next((i for i, (n, _) in enumerate(units) if n), 3)
    return " ".join(f"{n}{unit}" for n, unit in units[first:first + 2])


def _outcomes(table: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(table.items())) or "-"


def _dir_problem(directory: str) -> str | None:
    """Why keys cannot be written into ``directory`` (None: they can): it is a writable
    directory, or can be made in one."""
    if os.path.lexists(directory):
        if not os.path.isdir(directory):
            return "is not a directory"
        return None if os.access(directory, os.W_OK | os.X_OK) else "is not writable"
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
        return None
    return f"does not exist and cannot be created ({parent} is not writable)"


def _cmd_keygen(args: argparse.Namespace) -> int:
    from kvd.daemon.auth import KeyFileExists, write_keys

    directory = os.path.abspath(args.dir if args.dir is not None else DEFAULT_KEY_DIR)
    if args.dir is None:
        problem = _dir_problem(directory)
        if problem:
            raise _Refused("usage", f"the default key directory {directory} {problem}: run "
                                    "as a user who may write there (root), or give --dir DIR",
                           exit_code=2)
    try:
        public_file, secret_file, public = write_keys(directory, args.name)
    except KeyFileExists as exc:
        raise _Refused("key_exists", str(exc), exit_code=2) from None
    except OSError as exc:
        raise _Refused("cannot_write", f"cannot write keys into {directory}: "
                                       f"{exc.strerror or exc}", exit_code=1) from None
    allow_line = f"{public} HOST:PORT"
    if args.json:
        _print_json({"public_key_file": public_file, "secret_key_file": secret_file,
                     "public_key": public, "allow_list_line": allow_line})
        return 0
    print(f"public key: {public_file}\nsecret key: {secret_file} (mode 0600)")
    print("this daemon's config:")
    print(f'  curve_secret_key_file = "{secret_file}"')
    print('  curve_allowed_keys_file = "<the allow-list: one line per daemon>"')
    print("add this line to the allow-list (one file can serve every daemon; put this "
          "daemon's peer host:port):")
    print(allow_line)
    return 0


# --------------------------------------------------------------------------- the parser


class _UsageError(Exception):
    """A command line kvd does not take: argparse's complaint, raised to :func:`main`, which
    writes it as text (with the command's usage) or as JSON."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Refused(Exception):
    """A command that will not do what it was asked, for a reason of its own (no KvdError):
    ``code`` names it under --json."""

    def __init__(self, code: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.code, self.exit_code = code, exit_code


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--pool-size`` is not taken for ``--pool-size-bytes``), and errors
    raised, not printed: :func:`main` writes them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """What argparse left over, with the real option the first one most likely means."""
    first = next((arg for arg in extras if arg.startswith("--")), None)
    if first is None:
        return f"unrecognized arguments: {' '.join(extras)}"
    name = first.split("=", 1)[0]
    options = [option for action in parser._actions if action.help != argparse.SUPPRESS
               for option in action.option_strings if option.startswith("--")]
    hint = [option for option in options if option.startswith(name)] or \
        difflib.get_close_matches(name, options, n=1)
    if not hint or len(hint) > 3:
        return f"unrecognized option {name} (see {parser.prog} --help)"
    return f"unrecognized option {name}: did you mean {' or '.join(hint)}?"


def _checked(parse: Callable[[str], Any], rule: Callable[[Any], bool], words: str,
             expected: str = "") -> Callable[[str], Any]:
    """An argparse ``type``: ``parse`` (a ValueError: not ``expected``), then ``rule``;
    argparse names the option."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not rule(value):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    return convert


_SECONDS = _checked(float, lambda v: 0 < v < float("inf"), "a number of seconds > 0",
                    "a number")
_GRACE = _checked(float, lambda v: 0 <= v < float("inf"), "a number of seconds >= 0",
                  "a number")
_SIZE = _checked(parse_size, lambda v: v > 0, "a size > 0")
_FILE_NAME = _checked(str, lambda v: v not in ("", ".", "..") and "/" not in v,
                      "a file name, with no /, in --dir")


def _at_least(low: int) -> Callable[[str], Any]:
    return _checked(int, lambda v: v >= low, f"an integer >= {low}", "an integer")


def _client_options() -> _Parser:
    """What every client command takes: where the daemon is, how long to wait, --json."""
    common = _Parser(add_help=False)
    group = common.add_argument_group("the daemon")
    group.add_argument("--socket-path", metavar="PATH", default=None,
                       help="the daemon's local socket [default: env KVD_SOCKET_PATH, else "
                            "socket_path in the config file, else "
                            "$XDG_RUNTIME_DIR/kvd/kvd.sock, else /tmp/kvd-UID/kvd.sock]")
    group.add_argument("--config", metavar="PATH", default=None,
                       help="the daemon's TOML config file, read for socket_path only "
                            "[env KVD_CONFIG]")
    group.add_argument("--timeout", metavar="SECONDS", type=_SECONDS, default=5.0,
                       help="how long to wait for the daemon to answer [default 5]")
    output = common.add_argument_group("output")
    output.add_argument("--json", action="store_true",
                        help='one line of JSON; an error too, as {"error": {"code": ..., '
                             '"message": ...}} (same exit code)')
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvd", description="KV-cache transfer daemon")
    parser.add_argument("--version", action="version",
                        version=f"kvd {__version__} (protocol {PROTOCOL_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the daemon in the foreground",
        description="Run the kvd daemon in the foreground. Its settings are the flags below, "
                    "the same keys in a TOML file (--config) or KVD_<KEY> variables; "
                    "docs/operations.md explains each.")
    serve.add_argument("--check", action="store_true",
                       help="check the settings, print each as a config-file line with "
                            "where it came from, and exit (0; 2 and the error if one is "
                            "wrong); nothing is started, the socket's directory is not "
                            "checked")
    add_config_arguments(serve)
    serve.set_defaults(func=_cmd_serve, parser=serve)

    demo = sub.add_parser(
        "demo", help="start a daemon, move blocks between two clients, check the bytes",
        description="Start a daemon of its own on a private socket, move KV blocks between "
                    "two clients through it, check every byte, stop it.")
    demo.add_argument("--blocks", type=_at_least(4), default=64, metavar="N",
                      help="blocks in each region [>= 4; default 64]")
    demo.add_argument("--block-kib", type=_at_least(1), default=64, metavar="KIB",
                      help="KiB per block per tensor [default 64]")
    demo.add_argument("--layers", type=_at_least(1), default=4, metavar="N",
                      help="tensors in each region [default 4]")
    demo.set_defaults(func=_cmd_demo, parser=demo)

    keygen = sub.add_parser(
        "keygen", help="create a CurveZMQ key pair for the peer plane",
        description="Write this daemon's CurveZMQ key pair, NAME.key (public) and "
                    "NAME.key_secret (mode 0600), refusing to overwrite either; print their "
                    "absolute paths, the config lines that use them and the allow-list line.")
    keygen.add_argument("--dir", default=None, metavar="DIR",
                        help=f"where to write the keys, created if missing [default "
                             f"{DEFAULT_KEY_DIR}, when this user may write there; else "
                             f"required]")
    keygen.add_argument("--name", default="kvd", metavar="NAME", type=_FILE_NAME,
                        help="the files' name stem, a file name (no /) [default kvd]")
    keygen.add_argument("--json", action="store_true",
                        help="one line of JSON (the paths, the public key, the allow-list "
                             "line); an error too")
    keygen.set_defaults(func=_cmd_keygen, parser=keygen)

    # Listed here; its own parser reads its flags (main hands them over untouched).
    sub.add_parser("vllm-proxy", add_help=False,
                   help="the proxy in front of disaggregated vLLM prefill and decode "
                        "instances (kvd vllm-proxy --help)")

    common = _client_options()
    for name, func, help_text in (
        ("status", _cmd_status, "what the daemon is doing, as a table"),
        ("peers", _cmd_peers, "the peer daemons this one is linked to"),
        ("stats", _cmd_stats, "the daemon's counters as JSON"),
        ("ping", _cmd_ping, "check that the daemon answers"),
        ("drain", _cmd_drain, "stop taking work, finish in-flight work, exit; report"),
        ("reload", _cmd_reload, "read the allow-list again (curve_allowed_keys_file), as "
                                "SIGHUP does"),
        ("bench", _cmd_bench, "move data to a peer and back; throughput and latency"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() +
                           help_text[1:] + ".", parents=[common])
        p.set_defaults(func=func, parser=p)  # (parser: the one whose usage an error shows)
        if name == "drain":
            p.add_argument("--grace", type=_GRACE, default=None, metavar="SECONDS",
                           help="how long in-flight work may take before it is cancelled "
                                "[default: the daemon's drain_grace_s]")
        if name == "bench":
            own = p.add_argument_group("the benchmark")
            own.add_argument("--to", required=True, metavar="HOST:PORT",
                             help="the peer daemon's peer address (required)")
            own.add_argument("--size", type=_SIZE, default=parse_size("256MiB"),
                             metavar="SIZE", help="bytes per transfer, e.g. 1GiB; at most "
                                                  "the peer's host pool [default 256MiB]")
            own.add_argument("--blocks", type=_at_least(1), default=16, metavar="N",
                             help="blocks per transfer; they split --size evenly "
                                  "[default 16]")
            own.add_argument("--repeat", type=_at_least(1), default=5, metavar="N",
                             help="transfers each way [default 5]")
    return parser


def _wants_json(argv: Sequence[str]) -> bool:
    options = argv[:argv.index("--")] if "--" in argv else argv
    return "--json" in options


def _fail(as_json: bool, code: str, message: str, exit_code: int, label: str) -> int:
    if as_json:
        sys.stderr.flush()
        _print_json({"error": {"code": code, "message": message}})
    else:
        print(f"{label}: {message}", file=sys.stderr)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm-proxy"]:
        from kvd.integrations.vllm_proxy import main as proxy_main

        proxy_main(argv[1:])
        return 0
    as_json = _wants_json(argv)
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            args.parser.error(_unrecognized(args.parser, extras))
        code: int = args.func(args)
    except _UsageError as exc:
        if not as_json:
            exc.parser.print_usage(sys.stderr)
        return _fail(as_json, "usage", str(exc), 2, f"{exc.parser.prog}: error")
    except _Refused as exc:
        return _fail(as_json, exc.code, str(exc), exc.exit_code, f"kvd: {args.command}")
    except ConfigError as exc:
        return _fail(as_json, exc.code, str(exc), 2, "kvd: config error")
    except KvdError as exc:
        return _fail(as_json, exc.code, str(exc), 1, f"kvd: {exc.code}")
    except KeyboardInterrupt:
        return _fail(as_json, "interrupted", "interrupted", 130, "kvd")
    return code


if __name__ == "__main__":
    sys.exit(main())
