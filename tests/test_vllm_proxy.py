"""``kvd vllm-proxy``: the proxy ships with kvd. Started as a user starts it, on a real
socket, it answers what it can without vLLM: a body that is not JSON, an upstream that
does not listen. (Its forwarding between real vLLM servers is not run here: that takes an
HTTP server per engine; examples/vllm/README.md is the recipe.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import free_port


@pytest.fixture
def proxy() -> Iterator[str]:
    port, dead = free_port(), free_port()  # nothing listens on ``dead``
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.cli", "vllm-proxy", "--port", str(port),
         "--prefill", f"http://127.0.0.1:{dead}", "--decode", f"http://127.0.0.1:{dead}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "the proxy did not listen"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_proxy_answers_bad_bodies_and_dead_upstreams(proxy: str) -> None:
    status, body = post(proxy, b"[1, 2]")
    assert status == 400, body
    status, body = post(proxy, json.dumps({"model": "m", "prompt": "hi"}).encode())
    assert status == 502, body
    assert "127.0.0.1" in json.dumps(body)  # names the upstream it could not reach


def test_bad_flags_are_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "kvd.cli", "vllm-proxy", "--prefill",
                           "http://x", "--decode", "http://y", "--flow", "push"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--decode-kvd" in done.stderr
