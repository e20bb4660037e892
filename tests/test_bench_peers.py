"""benchmarks/peers.py, smoke-run: real `kvd serve` daemons and a raw TCP pair move real
bytes, the receiving sides check them, and the run leaves no process behind, whether it
finishes or is stopped half-way. NIXL and Mooncake are not needed (they are skipped where
not installed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import reap_tagged, tagged_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "peers.py")
MARK = "PEERS_SMOKE_RUN"  # set in the run's environment: how its processes are found



def start(tag: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, MARK: tag}
    return subprocess.Popen([sys.executable, BENCH, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[str], tag: str) -> tuple[str, str, list[tuple[int, str]]]:
    """The run's output once it has ended (killed after 80 s), and what it left behind."""
    try:
        out, err = proc.communicate(timeout=80)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = reap_tagged(MARK, tag)
    return out, err, left



@pytest.mark.timeout(90)
def test_quick_run_moves_checked_bytes_and_reports_positive_figures() -> None:
    """raw, kvd's put and the floor (benchmarks/peers_systems/floor.py: its put into a
    waiting get and its lend -> pull, with the bytes in the offer at 4 KiB and many, on the
    data connection at 1 MiB), each checked at the far end; no process left behind."""
    tag = uuid.uuid4().hex
    proc = start(tag, "--json", "--quick", "--rounds", "2", "--repeat", "3",
                 "--systems", "raw,kvd-put,floor")
    out, err, left = finish(proc, tag)
    assert proc.returncode == 0, err[-3000:]
    assert not left, f"the run left processes behind: {left}"
    res = json.loads(out.strip().splitlines()[-1])
    systems = ("raw", "kvd-put", "floor", "floor-pull")
    assert res["systems"] == list(systems)
    assert res["skipped"] == {}, res["skipped"]
    assert res["checks_passed"] is True
    assert res["checks"] == {s: {"4KiB": True, "1MiB": True, "many": True} for s in systems}
    for system in systems:
        for case in ("4KiB", "1MiB"):
            for stat in ("best_us", "p50_us", "p90_us", "median_gbps"):
                assert res[f"{system}_{case}_{stat}"] > 0, (system, case, stat)
            assert res[f"{system}_{case}_n"] == 6
        assert res[f"{system}_many_median_per_s"] > 0
        assert res[f"{system}_many_cpu_us_per_transfer"] > 0  # its processes' CPU, counted
    for system in ("floor", "floor-pull"):  # (its clients, like kvd's, run here)
        assert res[f"{system}_many_daemon_cpu_us_per_transfer"] > 0
        assert res[f"{system}_many_client_cpu_us_per_transfer"] > 0
    # kvd's clients run in the benchmark's process: their CPU is counted apart
    assert res["client_cpu_us_many"] > 0 and res["daemon_cpu_us_many"] > 0
    assert 0 < res["gc_longest_pause_ms"] < 1000  # the daemons' own, read at the end
    assert res["lat_4k_vs_floor"] > 0 and res["many_vs_floor"] > 0
    # NIXL was not asked for: its ratios are null, not made up.
    assert res["lat_4k_vs_nixl"] is None and res["many_vs_nixl"] is None


@pytest.mark.timeout(90)
def test_a_run_stopped_half_way_leaves_no_process() -> None:
    tag = uuid.uuid4().hex
    proc = start(tag, "--quick", "--rounds", "5000", "--repeat", "20", "--systems", "raw,kvd-put")
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # the first case has begun: daemons and workers are up
            if line.startswith("4KiB:") or time.monotonic() > deadline:
                break
        running = tagged_processes(MARK, tag)
        assert len(running) >= 4, running  # itself, raw's two sides, 2 daemons
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = reap_tagged(MARK, tag)
    assert proc.returncode != 0
    assert not left, f"the stopped run left processes behind: {left}"


def cuda_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.timeout(90)
@pytest.mark.skipif(cuda_here(), reason="a GPU is here: --device cuda would run for real")
def test_the_gpu_part_says_it_needs_a_gpu_and_leaves_its_ratios_null() -> None:
    tag = uuid.uuid4().hex
    proc = start(tag, "--device", "cuda", "--json")
    out, err, left = finish(proc, tag)
    assert proc.returncode == 2, err[-3000:]
    assert not left, left
    res = json.loads(out.strip().splitlines()[-1])
    assert "no CUDA device here" in res["error"]
    assert res["device"] == "cuda"
    for name in ("gpu_lat_1m_vs_floor", "gpu_lat_1m_vs_nixl", "gpu_contig_vs_raw",
                 "gpu_contig_vs_nixl", "gpu_paged_vs_raw", "gpu_paged_vs_nixl"):
        assert name in res and res[name] is None, name


def test_the_floors_stream_goes_in_whole_chunks_none_empty() -> None:
    """The floor's data connection moves a transfer in calls of CHUNK_BYTES: every run of
    views but the last holds exactly that, and none holds an empty view (which its
    receiver would read as the connection's end)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "peers_systems"))
    from floor import CHUNK_BYTES, chunks

    n = CHUNK_BYTES
    for sizes in ([n, n], [n // 2, n // 2, n], [3 * n + 7], [1, n - 1, 5], [0, n, 0], [n - 1]):
        data = [bytes([i]) * size for i, size in enumerate(sizes)]
        runs = list(chunks([memoryview(d) for d in data]))
        assert all(run and all(len(v) for v in run) for run in runs), sizes
        lengths = [sum(len(v) for v in run) for run in runs]
        assert lengths[:-1] == [n] * (len(runs) - 1) and 0 < lengths[-1] <= n, sizes
        assert b"".join(bytes(v) for run in runs for v in run) == b"".join(data), sizes


def test_the_byte_check_finds_a_flipped_byte_in_any_tensor() -> None:
    """The benchmark's check (sliced, per tensor) passes the bytes a transfer should leave
    and names a piece that differs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "peers_systems"))
    import numpy as np
    from cases import Case, check, fill

    case = Case.paged("p", tensors=3, blocks=16, block=4096, pick=5)
    src = np.empty(case.side_bytes, np.uint8)
    fill(src, 9)
    dst = np.zeros(case.side_bytes, np.uint8)
    s_off, d_off, length = case.pieces()
    for s, d in zip(s_off, d_off, strict=True):
        dst[d:d + length] = src[s:s + length]
    per = case.side_bytes // case.tensors
    tensors = [dst[i * per:(i + 1) * per] for i in range(case.tensors)]
    assert check(case, tensors, 9) == "" and check(case, dst, 9) == ""
    assert "15 of 15 pieces differ" in check(case, tensors, 10)
    dst[int(d_off[-1]) + length - 1] ^= 1
    assert check(case, tensors, 9) == (f"p: 1 of 15 pieces differ from the source (first at "
                                       f"destination offset {int(d_off[-1])})")
