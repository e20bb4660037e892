"""Operating kvd with real tools: promtool, a Prometheus server, systemd-analyze, a notify
socket, HTTP probes, and every CLI command against a daemon and against none."""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvd import KvdClient, shared_zeros
from kvd.daemon.metrics import BAD_MESSAGE_REASONS
from tests.conftest import READY_TIMEOUT_S, ProcessDaemon, wait_until
from tests.test_peers import Node, free_port, random_region

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    return subprocess.run([sys.executable, "-m", "kvd.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture
def two_nodes(sock_dir: str) -> Any:
    # Started side by side (each start is mostly its own interpreter's imports); if one
    # fails, the other is stopped.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(Node, sock_dir, name) for name in ("a", "b")]
    failed = [exc for f in starting if (exc := f.exception()) is not None]
    nodes = [f.result() for f in starting if f.exception() is None]
    try:
        if failed:
            raise failed[0]
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def move_some_data(a: Node, b: Node) -> None:
    src = random_region(4, 1)
    r = a.client.register("kv", [src])
    a.client.put("k1", r, [0, 1], to=b.address).wait(10)
    a.client.offload("k2", r, [2])
    dst = shared_zeros((4, 64 * 1024), torch.uint8)
    b.client.get("k1", b.client.register("kv", [dst]), [0, 1], timeout_s=5)


def promtool_checks(text: str) -> None:
    """``promtool check metrics`` is clean on ``text`` (skips where promtool is missing)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (.ci/run installs Debian's prometheus)")
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_metrics_pass_promtool_and_prometheus_scrapes_them(two_nodes: Any,
                                                           sock_dir: str) -> None:
    a, b = two_nodes
    move_some_data(a, b)
    http = a.client.stats()["http"]
    status, text = http_get(f"http://{http}/metrics")
    assert status == 200
    for name in ("kvd_transfers_total", "kvd_transfer_bytes_total",
                 "kvd_transfer_wire_seconds_bucket", "kvd_transfer_queue_wait_seconds_bucket",
                 "kvd_pool_used_bytes", "kvd_stored_keys", "kvd_peers_connected",
                 "kvd_clients_connected", "kvd_requests_total", "kvd_build_info",
                 "kvd_in_flight_transfers", "kvd_channels", "kvd_gpu_spills_total",
                 "kvd_nccl_channel_events_total", "kvd_pulls_waiting_for_key"):
        assert name in text, name
    assert 'kvd_channels{direction="send",transport="nccl"} 0.0' in text  # no GPUs here
    assert f'kvd_transfers_total{{direction="send",outcome="done",peer="{b.address}"' in text
    assert "_created" not in text  # (counters and histograms with samples would have them)
    promtool_checks(text)

    prometheus = shutil.which("prometheus")
    assert prometheus is not None
    port = free_port()
    cfg = os.path.join(sock_dir, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n"
                "scrape_configs:\n  - job_name: kvd\n"
                f"    static_configs:\n      - targets: ['{http}']\n")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={sock_dir}/tsdb",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        query = (f"http://127.0.0.1:{port}/api/v1/query?query=sum(kvd_transfers_total"
                 "%7Bdirection%3D%22send%22%2Coutcome%3D%22done%22%7D)")

        def scraped() -> Any:
            try:
                status, body = http_get(query, timeout=2)
            except OSError:
                return None
            result = json.loads(body)["data"]["result"] if status == 200 else []
            return result and float(result[0]["value"][1])

        assert wait_until(scraped, timeout_s=60, interval_s=0.5) == 1.0
    finally:
        proc.terminate()
        proc.wait(20)


# The calls that count a bad message, and which of their arguments is the reason.
_COUNTING_CALLS = {"count_bad": 0, "_count_bad": 0, "Count": 0, "refuse": 3, "_refuse": 3,
                   "Refusal": 1}
# self._bad.count(reason), .report(...), .note(...); plane.bad_input the same BadInput
_BAD_INPUT_CALLS = {"count": 0, "report": 0, "note": 0}
_LOCAL_SOCKET_FILES = {"local_server.py", "lifelines.py"}


def _reason_literals(node: ast.AST, function: ast.AST | None) -> set[str]:
    """The reason strings ``node`` (an argument) can be: a literal, either branch of an
    ``a if c else b``, or what a local variable of that name is assigned in ``function``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _reason_literals(node.body, function) | _reason_literals(node.orelse, function)
    if isinstance(node, ast.Name) and function is not None:
        found: set[str] = set()
        for assign in ast.walk(function):
            if isinstance(assign, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == node.id for t in assign.targets):
                found |= _reason_literals(assign.value, None)
        return found
    return set()


def bad_message_reasons_counted() -> dict[str, set[str]]:
    """Every reason kvd/daemon counts in ``bad_messages``, by socket, read from the code."""
    counted: dict[str, set[str]] = {"local": set(), "peer": set()}
    root = os.path.join(REPO, "kvd", "daemon")
    for directory, _dirs, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name)) as f:
                tree = ast.parse(f.read())
            socket_name = "local" if name in _LOCAL_SOCKET_FILES else "peer"
            functions = [n for n in ast.walk(tree)
                         if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            for function in functions:
                for call in ast.walk(function):
                    if not isinstance(call, ast.Call):
                        continue
                    func = call.func
                    called = func.attr if isinstance(func, ast.Attribute) else (
                        func.id if isinstance(func, ast.Name) else "")
                    if called == "_bad" and socket_name == "local":
                        position: int | None = 1  # _bad(identity, reason, req_id, err)
                    elif called in _BAD_INPUT_CALLS and isinstance(func, ast.Attribute) and \
                            isinstance(func.value, ast.Attribute) and \
                            func.value.attr in ("_bad", "bad_input"):
                        position = _BAD_INPUT_CALLS[called]
                    else:
                        position = _COUNTING_CALLS.get(called)
                    if position is None:
                        continue
                    args = call.args[position:position + 1] + [
                        k.value for k in call.keywords if k.arg == "bad"]
                    for arg in args:
                        counted[socket_name] |= _reason_literals(arg, function)
    return counted


def test_every_label_value_on_metrics_is_in_the_operators_guide(two_nodes: Any) -> None:
    """A small put (its bytes inline in the offer), a larger one (TCP), an offload (a
    local move): each label value they make is documented."""
    a, b = two_nodes
    move_some_data(a, b)
    small = a.client.register("small", [random_region(2, 3, block_bytes=4096)])
    a.client.put("k3", small, [0], to=b.address).wait(10)
    status, text = http_get(f"http://{a.client.stats()['http']}/metrics")
    assert status == 200
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        guide = f.read().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    seen: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label in ("direction", "transport", "outcome", "state", "event", "socket"):
                if label in sample.labels:
                    seen.setdefault(label, set()).add(sample.labels[label])
    assert "inline" in seen["transport"] and "tcp" in seen["transport"], seen
    assert {(label, value) for label, values in seen.items() for value in values
            if f"`{value}`" not in guide} == set()


def test_every_bad_message_reason_the_code_counts_is_exported_from_the_start() -> None:
    counted = bad_message_reasons_counted()
    assert len(counted["local"]) >= 10 and len(counted["peer"]) >= 15, counted  # it reads
    for socket_name, reasons in counted.items():
        missing = reasons - set(BAD_MESSAGE_REASONS[socket_name])
        assert not missing, f"add to BAD_MESSAGE_REASONS[{socket_name!r}]: {sorted(missing)}"
        stale = set(BAD_MESSAGE_REASONS[socket_name]) - reasons
        assert not stale, f"no longer counted ({socket_name}): {sorted(stale)}"


def dashboard_metric_names() -> set[str]:
    with open(os.path.join(REPO, "docs", "grafana", "kvd-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", []) if "expr" in target]
    exprs += [v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
              for v in dashboard["templating"]["list"]]
    return {name for expr in exprs for name in re.findall(r"\bkvd_[a-z_]+", expr)}


def test_metrics_at_start_bad_messages_at_zero_no_created_and_the_dashboard_s_names(
        sock_dir: str) -> None:
    d = ProcessDaemon(sock_dir).wait_ready()
    try:
        with KvdClient(d.socket_path, timeout_s=10) as c:
            http = c.stats()["http"]
        status, text = http_get(f"http://{http}/metrics")
    finally:
        d.stop()
    assert status == 200
    assert "_created" not in text
    families = list(text_string_to_metric_families(text))
    bad = {(s.labels["socket"], s.labels["reason"]): s.value
           for f in families if f.name == "kvd_bad_messages" for s in f.samples}
    expected = {(sock, reason) for sock, reasons in BAD_MESSAGE_REASONS.items()
                for reason in reasons}
    assert set(bad) == expected and set(bad.values()) == {0.0}, bad
    # Every name the dashboard queries is on /metrics (a family with no samples yet, such
    # as GPU staging without GPUs, counts: its # TYPE line is there).
    exported: set[str] = set()
    for f in families:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        exported |= {f.name + s for s in suffixes.get(f.type, [""])}
    used = dashboard_metric_names()
    assert {"kvd_gpu_staging_bytes", "kvd_nccl_channel_events_total",
            "kvd_pulls_waiting_for_key", "kvd_bad_messages_total"} <= used
    assert used <= exported, sorted(used - exported)
    promtool_checks(text)


def test_health_status_and_peers_endpoints(two_nodes: Any) -> None:
    a, b = two_nodes
    move_some_data(a, b)
    http = a.client.stats()["http"]
    assert http_get(f"http://{http}/healthz") == (200, '{"ok": true}')
    status, body = http_get(f"http://{http}/readyz")
    assert status == 200 and json.loads(body)["ready"] is True
    status, body = http_get(f"http://{http}/v1/status")
    st = json.loads(body)
    assert status == 200 and st["node_id"] == "a" and st["keys"] == 1
    # What start-up made (torch's ~190,000 objects among it) is frozen: a full garbage
    # collection, which walked it all in 130-140 ms on the loop, walks only what came since.
    assert st["gc"]["frozen_objects"] > 50_000 and st["gc"]["longest_pause_s"] < 0.05, st["gc"]
    status, body = http_get(f"http://{http}/v1/peers")
    peers = json.loads(body)
    assert [link["address"] for link in peers["links"]] == [b.address]
    assert peers["links"][0]["epoch"] > 0 and "last_heard_s_ago" in peers["links"][0]


def test_readyz_waits_for_the_pool_and_configured_peers(sock_dir: str) -> None:
    peer_port = free_port()
    d = ProcessDaemon(sock_dir, "--pool-size-bytes", "3GiB", "--http-port",
                      str(http_port := free_port()), "--peers", f"127.0.0.1:{peer_port}",
                      "--heartbeat-interval-s", "0.2")
    other = None
    try:
        url = f"http://127.0.0.1:{http_port}/readyz"
        seen: list[str] = []

        def answered() -> Any:
            try:
                status, body = http_get(url, timeout=1)
            except OSError:
                return None
            seen.extend(json.loads(body)["reasons"])
            return status

        wait_until(answered, timeout_s=READY_TIMEOUT_S, interval_s=0.01)  # HTTP is up
        # The pool is being allocated: not ready, and it says why.
        wait_until(lambda: any("peer" in r for r in seen) or answered() is None, timeout_s=60)
        assert any("pool" in r for r in seen), seen
        status, body = http_get(url)
        assert status == 503 and f"127.0.0.1:{peer_port} unreachable" in body
        other_dir = os.path.join(sock_dir, "other")
        os.makedirs(other_dir)
        other = ProcessDaemon(other_dir, "--peer-port", str(peer_port))
        other.wait_ready()
        assert wait_until(lambda: http_get(url)[0] == 200, timeout_s=20)
    finally:
        if other is not None:
            other.stop()
        d.stop()


def test_systemd_unit_verifies(sock_dir: str) -> None:
    analyze = shutil.which("systemd-analyze")
    kvd_bin = shutil.which("kvd") or os.path.join(os.path.dirname(sys.executable), "kvd")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (.ci/run installs Debian's systemd)")
    with open(os.path.join(REPO, "systemd", "kvd.service")) as f:
        unit = f.read()
    assert "\nExecStart=/usr/local/bin/kvd " in unit and "Type=notify" in unit
    path = os.path.join(sock_dir, "kvd.service")
    with open(path, "w") as f:  # the installed binary's path differs in a venv
        f.write(unit.replace("ExecStart=/usr/local/bin/kvd ", f"ExecStart={kvd_bin} "))
    result = subprocess.run([analyze, "verify", path], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr)
    from kvd.config import load_config

    cfg = load_config(config_file=os.path.join(REPO, "systemd", "kvd.toml"), env={},
                      check_paths=False)
    assert cfg.socket_path == "/run/kvd/kvd.sock"


def test_notify_socket_ready_watchdog_stopping(sock_dir: str) -> None:
    notify_path = os.path.join(sock_dir, "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(READY_TIMEOUT_S)  # READY=1 comes once the daemon is up
    d = ProcessDaemon(sock_dir, env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"})
    try:
        messages: list[str] = []

        def until(word: str) -> None:
            while not any(word in m for m in messages):
                messages.append(listener.recv(4096).decode())

        until("READY=1")
        # READY means clients are served now, not soon.
        with KvdClient(d.socket_path, timeout_s=2) as c:
            assert c.ping() > 0
        ready_at = len(messages)
        t0 = time.monotonic()
        while sum("WATCHDOG=1" in m for m in messages[ready_at:]) < 3:
            messages.append(listener.recv(4096).decode())
        assert time.monotonic() - t0 < 2.0  # every ~0.1 s (half of WATCHDOG_USEC)
        d.signal(signal.SIGTERM)
        until("STOPPING=1")
        assert d.proc.wait(30) == 0
        assert any("STATUS=" in m for m in messages)
    finally:
        d.stop()
        listener.close()


def test_cli_commands_against_a_daemon(two_nodes: Any) -> None:
    a, b = two_nodes
    move_some_data(a, b)
    sock = a.proc.socket_path
    result = run_cli("status", "--socket-path", sock)
    assert result.returncode == 0, result.stderr
    assert "host pool" in result.stdout and "ready" in result.stdout
    assert "transfers sent" in result.stdout and "done 1" in result.stdout
    result = run_cli("status", "--socket-path", sock, "--json")
    assert json.loads(result.stdout)["node_id"] == "a"
    result = run_cli("peers", "--socket-path", sock)
    assert result.returncode == 0 and b.address in result.stdout and "ADDRESS" in result.stdout
    row = next(line for line in result.stdout.splitlines() if b.address in line)
    assert "tcp-send" in row and "tcp-recv" in row and " 0 " in row  # b has no GPUs
    result = run_cli("bench", "--socket-path", sock, "--to", b.address, "--size", "8MiB",
                     "--blocks", "4", "--repeat", "3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["intact"] is True and report["put_gbps_median"] > 0
    assert b.client.stats()["keys"] == 0  # the pulls took everything back
    result = run_cli("drain", "--socket-path", sock, "--json")
    assert result.returncode == 0, result.stderr + a.proc.log()
    assert json.loads(result.stdout)["cancelled"] == 0
    assert a.proc.proc.wait(30) == 0


@pytest.mark.parametrize("command", [["status"], ["peers"], ["drain"], ["stats"], ["ping"],
                                     ["bench", "--to", "127.0.0.1:1"]])
def test_cli_commands_without_a_daemon(command: list[str]) -> None:
    missing = os.path.join(tempfile.gettempdir(), f"kvd-none-{os.getpid()}", "kvd.sock")
    t0 = time.monotonic()
    result = run_cli(*command, "--socket-path", missing, "--timeout", "2", timeout=30)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and missing in lines[0], result.stderr
    assert time.monotonic() - t0 < 20
