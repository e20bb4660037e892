"""kvd measured beside the systems its users would pick instead, alternated in one run.

Run (in the virtualenv that benchmarks/install_peers.sh builds, which holds the peers):
``.venv-peers/bin/python benchmarks/peers.py [--json] [--quick] [--full]
[--systems raw,floor,kvd-put,kvd-pull,nixl,mooncake] [--rounds N] [--repeat N]``

CPU (``--device cpu``, the default): every system moves real bytes between two processes on
loopback, DRAM to DRAM, and the receiving side checks them:

* **raw**: plain TCP, one connection kept, ``sendmsg``/``recvmsg_into`` straight from the
  source pieces into the destination pieces (scatter-gather, no copy in Python), a 1-byte
  ack after the last byte; timed on the sender from the header to the ack.
* **floor** and **floor-pull** (``--systems floor`` brings both): kvd's design with nothing
  of kvd in it (benchmarks/peers_systems/floor.py, whose docstring lists the messages hop
  by hop): two daemon processes on uvloop, its clients here as kvd's are, kvd's messages
  in kvd's order over the same ZeroMQ sockets, the bytes in the offer (up to 64 KiB) or
  on one TCP connection; timed as kvd-put and kvd-pull are. What kvd costs above it is
  kvd's to remove.
* **kvd-put**: two ``kvd serve`` daemons (a, b), this process a client of both. The get is
  posted on b first; the time runs from ``put(..., to=b)`` to both the put and the get
  having returned.
* **kvd-pull**: the same daemons; the time runs from ``lend`` on a to ``pull`` on b
  returning (the pull waits for the key if it gets there before the lend).
* **nixl**: NIXL (nixl-cu12 1.5.1, its bundled UCX with ``UCX_TLS=tcp``), two agents with
  the UCX backend. The target's progress thread is on (over tcp nothing else progresses
  the passive side); the initiator's is off, since its own polling progresses it and a
  second spinning thread would take a core from it (on 2 cores the two settings measured
  alike). The initiator prepares both descriptor lists and a WRITE handle once, then
  reposts the handle and polls it to DONE.
* **mooncake**: Mooncake Transfer Engine (0.3.13.post1, non-CUDA build), P2PHANDSHAKE
  metadata, the tcp protocol, a synchronous (batch) write.

GPU (``--device cuda``, one GPU; ``bash .ci/gpu peers`` on the device machine, with the
nixl-cu13 wheel that benchmarks/gpu_peer_wheels.sh puts in .whl/):

* **raw**: in this process, ``dst.copy_(src)`` (contiguous) or one launch of kvd's
  gather/scatter kernel (paged), from the launch to ``torch.cuda.synchronize()``;
* **floor**: one floor daemon, both clients here on it, regions by CUDA IPC: a put into a
  get waiting there, the copy one launch (as raw's) and an event polled on its loop;
* **kvd-put**: one ``kvd serve`` on the GPU, both regions registered by CUDA IPC from
  this process (two clients); a put into a get already waiting on the same daemon (its
  local path: one kernel, GPU to GPU), timed until both have returned;
* **nixl**: two processes, VRAM to VRAM, UCX's cuda_ipc (UCX_TLS left to UCX), a prepared
  WRITE handle reposted and polled to DONE, as on the CPU.

Its cases: 1 MiB, 512 MiB contiguous and the paged request below.

Cases: 4 KiB, 1 MiB, 64 MiB, 1 GiB (with ``--full``, or when memory allows every system
its two GiB), and ``paged``: 64 tensors of 512 blocks of 32 KiB each side, the same 256
random source blocks of every tensor to 256 random destination blocks (512 MiB in 16,384
pieces). ``many``: 64 transfers of 64 KiB in flight at once (one per block), transfers/s.

Each case is set up on every system, moved once and checked (the destination cleared
first), then measured in ``--rounds`` rounds; in each round every system runs
``--repeat`` transfers in turn (the order rotates), and the destination is checked again
after the last round. A system not being measured is paused (SIGSTOP on its processes,
SIGCONT before its turn): an idle NIXL agent's progress thread spins on a core, which on a
small machine slows whatever runs beside it. A system that cannot start (not installed: see
install_peers.sh) or fails is skipped with its reason; its ratios are null.

Figures: latency in µs (best, p50 = median, p90) and throughput in GB/s (1e9 B/s; best,
median, p90: the throughput of the p90 time); for ``many`` also the CPU time per transfer,
from /proc: of the system's processes (``..._daemon_cpu_us_per_transfer`` where its
clients run here: kvd's and the floor's), of those clients (``..._client_cpu_us_...``:
this process's main thread, which makes the client calls, and ZeroMQ's I/O threads,
counted over the client calls only, not the harness's waits; torch's OpenMP threads,
which torch's CPU kernels leave spinning after each parallel region, are not counted, and
host memory is filled and checked with numpy), and both (``..._cpu_us_per_transfer``).
Each kvd system's ratio to its floor, to raw, NIXL and Mooncake, per case, is printed
(``ratios_by_case`` in the JSON): for latency its time over theirs (lower is better), for
GB/s and transfers/s its rate over theirs (higher is better). ``--json`` prints one JSON
object last, with every figure and the ratios ``lat_4k_vs_floor``, ``lat_1m_vs_floor``
(kvd-put p50 over the floor's), ``bulk_64m_vs_floor``, ``bulk_1g_vs_floor``,
``paged_vs_floor`` (median GB/s), ``many_vs_floor`` (transfers/s), ``bulk_64m_vs_raw``,
``daemon_cpu_us_many`` and ``client_cpu_us_many`` (kvd-put's), ``lat_4k_vs_nixl`` and
``lat_1m_vs_nixl`` (kvd-put p50 over NIXL's), ``bulk_64m_vs_best_peer`` (kvd-put median
GB/s over the best of NIXL's and Mooncake's), ``many_vs_nixl`` (transfers/s), each also
for kvd-pull (``..._pull``, against floor-pull); on the GPU ``gpu_lat_1m_vs_floor``,
``gpu_lat_1m_vs_nixl`` (p50), ``gpu_contig_vs_floor``, ``gpu_contig_vs_raw``,
``gpu_contig_vs_nixl`` (512 MiB, median GB/s), ``gpu_paged_vs_floor``,
``gpu_paged_vs_raw`` and ``gpu_paged_vs_nixl`` (paged, median GB/s); and on both
``gc_longest_pause_ms``, the longest garbage collection either kvd daemon's loop took
over the whole run (its ``kvd status``).

Every process the run starts is in its own process group, killed (SIGCONT, SIGTERM, then
SIGKILL) when the run ends however it ends; the children also die with this process
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers_systems"))
import tcp_transfer  # noqa: E402  (benchmarks/, this script's own directory)
from cases import Case, GiB, KiB, MiB, check, fill  # noqa: E402
from floor import Floor  # noqa: E402

now = time.perf_counter
SYSTEMS = ("raw", "floor", "floor-pull", "kvd-put", "kvd-pull", "nixl", "mooncake")
# kvd's flows and their floors: each kvd system's figures are divided by its floor's
FLOORS = {"kvd-put": "floor", "kvd-pull": "floor-pull"}
LATENCY_LABELS = ("4KiB", "1MiB")  # reported in µs; the rest in GB/s
MANY = Case.paged("many", tensors=1, blocks=64, block=64 * KiB, pick=64, seed=11)
PAGED = Case.paged("paged", tensors=64, blocks=512, block=32 * KiB, pick=256)
REPLY_TIMEOUT_S = 300.0
KVD_BLOCK = 16 * MiB
PEERS_STATUS = os.path.join(HERE, "..", ".venv-peers", "peers-status.txt")


# ------------------------------------------------------------------ children


class Children:
    """Every process this run starts, each the leader of its own process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                preexec_fn=die_with_parent, **kw)
        self.procs.append(proc)
        return proc

    def signal(self, procs: list[subprocess.Popen[bytes]], sig: int) -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)

    def stop(self, procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
        """SIGCONT (a stopped process cannot act on SIGTERM), SIGTERM, then SIGKILL."""
        self.signal(procs, signal.SIGCONT)
        self.signal(procs, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        self.signal(procs, signal.SIGKILL)  # the group too: whatever the leader started
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        self.procs = [p for p in self.procs if p not in procs]

    def stop_all(self) -> None:
        self.stop(list(self.procs))


CHILDREN = Children()
atexit.register(CHILDREN.stop_all)


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the finally blocks, then atexit


class Skip(Exception):
    """This system cannot be measured; the message says why."""


# ------------------------------------------------------------------ systems


class System:
    """One system under test: started once, set up per case, paused between turns."""

    name = ""
    # CPU seconds its clients spent in this process during ``many`` so far (for the
    # systems whose clients run here: kvd's and the floor's), read and reset by Run
    client_cpu_s = 0.0

    def start(self) -> None: ...
    def procs(self) -> list[subprocess.Popen[bytes]]: return []
    def setup(self, case: Case) -> None: ...
    def verify(self, case: Case, seed: int, move: bool) -> None: ...
    def time(self, case: Case, repeat: int) -> list[float]: raise NotImplementedError
    def many(self, repeat: int) -> list[float]: raise NotImplementedError
    def free(self, case: Case) -> None: ...
    def clear(self) -> None:
        """Clear the destination, so that the timed transfers must deliver the bytes again."""

    def pause(self) -> None:
        CHILDREN.signal(self.procs(), signal.SIGSTOP)

    def resume(self) -> None:
        CHILDREN.signal(self.procs(), signal.SIGCONT)

    def stop(self) -> None:
        CHILDREN.stop(self.procs())


class WorkerSystem(System):
    """A library system: benchmarks/peers_systems/workers.py as target and initiator."""

    def __init__(self, name: str, env: dict[str, str], root: str) -> None:
        self.name, self.env, self.root = name, env, root
        self.logs: dict[str, str] = {}
        self.target: subprocess.Popen[bytes] | None = None
        self.initiator: subprocess.Popen[bytes] | None = None
        self.target_md: dict[str, Any] = {}

    def start(self) -> None:
        script = os.path.join(HERE, "peers_systems", "workers.py")
        env = {**os.environ, **self.env}
        for role in ("target", "initiator"):
            self.logs[role] = os.path.join(self.root, f"{self.name}-{role}.log")
            with open(self.logs[role], "wb") as log:
                proc = CHILDREN.spawn([sys.executable, script, self.name, role], env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=log)
            setattr(self, role, proc)
            hello = self.read(proc, 120.0)
            if "error" in hello:
                raise Skip(hello["error"])

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in (self.target, self.initiator) if p is not None]

    def read(self, proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            raise RuntimeError(f"{self.name}: no answer within {timeout_s:g}s")
        line = proc.stdout.readline()
        if not line:
            role = "target" if proc is self.target else "initiator"
            tail = ""
            with contextlib.suppress(OSError), open(self.logs[role], errors="replace") as f:
                tail = f.read()[-1500:]
            raise RuntimeError(f"{self.name} {role} exited (code {proc.wait(5)}): {tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, proc: subprocess.Popen[bytes] | None, op: str, **args: Any
            ) -> dict[str, Any]:
        assert proc is not None and proc.stdin is not None
        proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        proc.stdin.flush()
        reply = self.read(proc, REPLY_TIMEOUT_S)
        if reply.get("error"):
            raise RuntimeError(reply["error"])
        return reply

    def setup(self, case: Case) -> None:
        self.target_md = self.ask(self.target, "setup", case=case.to_json())
        self.ask(self.initiator, "setup", case=case.to_json(), peer=self.target_md)

    def verify(self, case: Case, seed: int, move: bool) -> None:
        if move:
            self.ask(self.initiator, "fill", seed=seed)
            self.ask(self.target, "zero")
            self.ask(self.initiator, "many" if case is MANY else "time", repeat=1)
        self.ask(self.target, "check", seed=seed)

    def clear(self) -> None:
        self.ask(self.target, "zero")

    def time(self, case: Case, repeat: int) -> list[float]:
        return [float(t) for t in self.ask(self.initiator, "time", repeat=repeat)["times"]]

    def many(self, repeat: int) -> list[float]:
        return [float(t) for t in self.ask(self.initiator, "many", repeat=repeat)["times"]]

    def free(self, case: Case) -> None:
        self.ask(self.initiator, "free")
        self.ask(self.target, "free")


class KvdDaemons:
    """Two ``kvd serve`` daemons (a sends, b receives) and this process's clients; on the
    GPU (``device`` cuda) one daemon, whose local path both clients use."""

    def __init__(self, root: str, device: str = "cpu") -> None:
        self.root, self.device = root, device
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.started = False
        self.failed = ""
        self.gc_longest_pause_ms: float | None = None  # either daemon's, read at close

    def start(self) -> None:
        if self.started:
            if self.failed:
                raise Skip(self.failed)
            return
        self.started = True
        from kvd import KvdClient

        try:
            a_path = self.daemon("a")
            b_path = self.daemon("b") if self.device == "cpu" else a_path
            self.tx = KvdClient(a_path, name="peers-tx", timeout_s=120.0)
            self.rx = KvdClient(b_path, name="peers-rx", timeout_s=120.0)
            self.watch = KvdClient(b_path, name="peers-watch", timeout_s=120.0)
            for c in (self.tx, self.rx, self.watch):
                c.connect()
            self.a_addr = self.tx.stats()["peer"]["address"]
            # None on the GPU: the put stays on a, into the get waiting there
            self.b_addr = self.watch.stats()["peer"]["address"] if b_path != a_path else None
        except BaseException as exc:
            self.failed = f"kvd daemons did not start: {exc!r}"
            raise

    def daemon(self, name: str) -> str:
        from kvd import KvdClient, KvdError

        os.makedirs(os.path.join(self.root, name))
        path = os.path.join(self.root, name, "kvd.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        # peer_grace_s: both daemons are paused together while another system runs; a
        # long pause must not read as a dead peer when they resume.
        cmd = [sys.executable, "-m", "kvd.cli", "serve", "--socket-path", path,
               "--node-id", f"peers-{name}", "--peer-port", "0", "--data-port", "0",
               "--http-port", "0", "--pool-size-bytes", "256MiB", "--peer-grace-s", "3600",
               "--log-level", "warning"]
        with open(os.path.join(self.root, name, "daemon.log"), "wb") as log:
            proc = CHILDREN.spawn(cmd, env, stdout=log, stderr=subprocess.STDOUT)
        self.daemons.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(path):
                with contextlib.suppress(KvdError), KvdClient(path, timeout_s=1.0) as c:
                    c.ping()
                    return path
            time.sleep(0.05)
        raise RuntimeError(f"kvd daemon {name} not ready (exit code {proc.poll()}): "
                           f"{self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.root, name, "daemon.log"),
                                                errors="replace") as f:
            return f.read()[-2000:]
        return ""

    def close(self) -> None:
        if self.started and not self.failed:  # (stats: the daemons' own status)
            CHILDREN.signal(self.daemons, signal.SIGCONT)  # (paused while others ran)
            with contextlib.suppress(Exception):
                self.gc_longest_pause_ms = round(1e3 * max(
                    c.stats(timeout_s=10.0)["gc"]["longest_pause_s"]
                    for c in (self.tx, self.watch)), 2)
        for c in ("tx", "rx", "watch"):
            with contextlib.suppress(Exception):
                getattr(self, c).close()
        CHILDREN.stop(self.daemons, grace_s=30.0)
        self.daemons = []


class TensorPair:
    """One case's source and destination tensors (block dimension first): shared host
    memory, or GPU memory with ``device`` cuda. A contiguous case is one tensor of blocks of
    at most ``KVD_BLOCK``, moved whole."""

    def __init__(self, case: Case, device: str) -> None:
        import torch

        from kvd import shared_empty

        shape = ((case.block // min(case.block, KVD_BLOCK), min(case.block, KVD_BLOCK))
                 if case.kind == "contig" else (case.blocks, case.block))

        def new() -> torch.Tensor:
            if device == "cuda":
                return torch.zeros(shape, dtype=torch.uint8, device="cuda")
            return shared_empty(shape, torch.uint8)

        self.src = [new() for _ in range(case.tensors)]
        self.dst = [new() for _ in range(case.tensors)]
        if case.kind == "contig":
            self.src_ids = self.dst_ids = list(range(shape[0]))
        else:
            s, t = case.block_ids()
            self.src_ids, self.dst_ids = s.tolist(), t.tolist()

    # Host memory is filled, cleared and checked with numpy, not torch: torch's CPU
    # kernels run on its OpenMP threads, which spin on a core after each parallel region,
    # in this process, where kvd's clients run and their CPU is measured.

    def fill(self, case: Case, seed: int) -> None:
        import torch

        per = case.side_bytes // case.tensors
        for i, t in enumerate(self.src):
            if t.is_cuda:
                part = np.empty(per, np.uint8)
                fill(part, seed, offset=i * per)
                t.view(-1).copy_(torch.from_numpy(part))
            else:
                fill(t.numpy().reshape(-1), seed, offset=i * per)
        sync(self.src)

    def clear(self) -> None:
        for t in self.dst:
            if t.is_cuda:
                t.zero_()
            else:
                t.numpy().fill(0)
        sync(self.dst)

    def check(self, case: Case, seed: int) -> str:
        return check(case, [(t.cpu() if t.is_cuda else t).numpy().reshape(-1)
                            for t in self.dst], seed)


class KvdRegions(TensorPair):
    """A pair registered with kvd: the source with a (the sender's client), the destination
    with b (the receiver's; a too on the GPU)."""

    def __init__(self, d: KvdDaemons, case: Case, tag: str) -> None:
        super().__init__(case, d.device)
        self.r_src = d.tx.register(f"{tag}-src-{case.label}", self.src)
        self.r_dst = d.rx.register(f"{tag}-dst-{case.label}", self.dst)


def sync(tensors: list[Any]) -> None:
    """Wait for this process's queued GPU work on ``tensors`` (nothing for host memory)."""
    if tensors and tensors[0].is_cuda:
        import torch

        torch.cuda.synchronize(tensors[0].device)


class InProcessPair(System):
    """A system whose case is a ``TensorPair`` in this process (``tensors``): filled,
    cleared and checked here."""

    def tensors(self) -> TensorPair:
        raise NotImplementedError

    def verify(self, case: Case, seed: int, move: bool) -> None:
        pair = self.tensors()
        if move:
            pair.fill(case, seed)
            pair.clear()
            self.many(1) if case is MANY else self.time(case, 1)
        error = pair.check(case, seed)
        if error:
            raise RuntimeError(error)

    def clear(self) -> None:
        self.tensors().clear()


class KvdSystem(InProcessPair):
    """kvd through its client, on the shared pair of daemons: ``put`` to a waiting get,
    or ``lend`` then ``pull``."""

    def __init__(self, name: str, daemons: KvdDaemons) -> None:
        self.name, self.d = name, daemons
        self.regions: KvdRegions | None = None
        self.keys = 0

    def start(self) -> None:
        self.d.start()

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return list(self.d.daemons)

    def stop(self) -> None:
        pass  # the daemons are shared; run() closes them

    def setup(self, case: Case) -> None:
        self.regions = KvdRegions(self.d, case, self.name)

    def key(self) -> str:
        self.keys += 1
        return f"{self.name}-{self.keys}"

    def tensors(self) -> TensorPair:
        assert self.regions is not None
        return self.regions

    def wait_gets(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while self.d.watch.stats()["waiting_gets"] < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} gets never all waited on daemon b")
            time.sleep(0.0005)

    def one(self, src_ids: list[int], dst_ids: list[int], nbytes: int) -> float:
        r = self.regions
        assert r is not None
        key = self.key()
        if self.name == "kvd-put":
            get = self.d.rx.start_get(key, r.r_dst, dst_ids, timeout_s=60)
            self.wait_gets(1)
            t0 = now()
            sent = self.d.tx.put(key, r.r_src, src_ids, to=self.d.b_addr, timeout_s=60).wait(60)
            got = get.wait(60)
            t1 = now()
        else:
            t0 = now()
            lend = self.d.tx.lend(key, r.r_src, src_ids, ttl_s=60)
            got = self.d.rx.pull(key, self.d.a_addr, r.r_dst, dst_ids, timeout_s=60,
                                 wait_for_key_s=10)
            t1 = now()
            sent = lend.wait(60)
        if sent != nbytes or got != nbytes:
            raise RuntimeError(f"{self.name}: sent {sent}, got {got} bytes; expected {nbytes}")
        return t1 - t0

    def time(self, case: Case, repeat: int) -> list[float]:
        r = self.regions
        assert r is not None
        return [self.one(r.src_ids, r.dst_ids, case.nbytes) for _ in range(repeat)]

    def many(self, repeat: int) -> list[float]:
        r = self.regions
        assert r is not None
        pairs = list(zip(r.src_ids, r.dst_ids, strict=True))
        times = []
        for _ in range(repeat):
            keys = [self.key() for _ in pairs]
            if self.name == "kvd-put":
                c0 = client_cpu_s()
                gets = [self.d.rx.start_get(k, r.r_dst, [d], timeout_s=60)
                        for k, (_, d) in zip(keys, pairs, strict=True)]
                self.client_cpu_s += client_cpu_s() - c0
                self.wait_gets(len(keys))  # (the harness's, not the transfers')
                c0 = client_cpu_s()
                t0 = now()
                puts = [self.d.tx.put(k, r.r_src, [s], to=self.d.b_addr, timeout_s=60)
                        for k, (s, _) in zip(keys, pairs, strict=True)]
                moved = [t.wait(60) for t in puts] + [g.wait(60) for g in gets]
                t1 = now()
            else:
                c0 = client_cpu_s()
                t0 = now()
                lends = [self.d.tx.lend(k, r.r_src, [s], ttl_s=60)
                         for k, (s, _) in zip(keys, pairs, strict=True)]
                pulls = [self.d.rx.start_pull(k, self.d.a_addr, r.r_dst, [d], timeout_s=60,
                                              wait_for_key_s=10)
                         for k, (_, d) in zip(keys, pairs, strict=True)]
                moved = [p.wait(60) for p in pulls]
                t1 = now()
                moved += [lend.wait(60) for lend in lends]
            self.client_cpu_s += client_cpu_s() - c0
            if any(n != MANY.block for n in moved):
                raise RuntimeError(f"{self.name} many: moved {sorted(set(moved))} bytes")
            times.append(t1 - t0)
        return times

    def free(self, case: Case) -> None:
        r = self.regions
        if r is not None:
            self.regions = None
            self.d.tx.unregister(r.r_src)
            self.d.rx.unregister(r.r_dst)


class FloorDaemons:
    """The floor's daemons and this process's clients of them (``floor.Floor``), shared by
    its two flows: started once, by whichever asks first."""

    def __init__(self, root: str, device: str = "cpu") -> None:
        self.floor = Floor(root, CHILDREN.spawn, device, timeout_s=REPLY_TIMEOUT_S)
        self.started = False
        self.failed = ""

    def start(self) -> None:
        if self.started:
            if self.failed:
                raise Skip(self.failed)
            return
        self.started = True
        try:
            self.floor.start()
        except BaseException as exc:
            self.failed = f"the floor's daemons did not start: {exc!r}"
            raise

    def close(self) -> None:
        CHILDREN.signal(self.floor.procs(), signal.SIGCONT)  # (paused: stdin's end unread)
        with contextlib.suppress(Exception):
            self.floor.close()
        CHILDREN.stop(self.floor.procs())


class FloorSystem(InProcessPair):
    """The floor (benchmarks/peers_systems/floor.py: kvd's design with nothing of kvd in
    it), its clients here as kvd's are: ``floor`` a put into a get waiting on b,
    ``floor-pull`` a lend on a then a pull from b, each timed as ``KvdSystem`` times kvd's
    (on the GPU, ``floor``: one daemon, the put into a get waiting there)."""

    def __init__(self, name: str, daemons: FloorDaemons) -> None:
        self.name, self.d, self.f = name, daemons, daemons.floor
        self.pair: TensorPair | None = None
        self.regions = (0, 0)
        self.keys = 0

    def start(self) -> None:
        self.d.start()

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return self.f.procs()

    def stop(self) -> None:
        pass  # the daemons are shared; run() closes them

    def setup(self, case: Case) -> None:
        self.pair = TensorPair(case, self.f.device)
        self.regions = (self.f.map("a", self.pair.src),
                        self.f.map(self.f.receiver, self.pair.dst))

    def tensors(self) -> TensorPair:
        assert self.pair is not None
        return self.pair

    def key(self) -> str:
        self.keys += 1
        return f"{self.name}-{self.keys}"

    def transfers(self, src_ids: list[list[int]], dst_ids: list[list[int]]) -> tuple[
            float, list[int]]:
        """Seconds of ``len(src_ids)`` transfers in flight at once, and the bytes each
        side was told moved; the client's CPU counted as in ``KvdSystem``."""
        keys = [self.key() for _ in src_ids]
        f, (src, dst), n = self.f, self.regions, len(keys)
        if self.name == "floor":
            c0 = client_cpu_s()
            f.gets(keys, dst, dst_ids)
            self.client_cpu_s += client_cpu_s() - c0
            f.rx.fence()  # b holds every get (the harness's, not the transfers')
            c0 = client_cpu_s()
            t0 = now()
            f.puts(keys, src, src_ids)
            moved = f.tx.done(n) + f.rx.done(n)
            t1 = now()
        else:
            c0 = client_cpu_s()
            t0 = now()
            f.lends(keys, src, src_ids)
            f.pulls(keys, dst, dst_ids)
            moved = f.rx.done(n)
            t1 = now()
            moved += f.tx.done(n)
        self.client_cpu_s += client_cpu_s() - c0
        return t1 - t0, moved

    def time(self, case: Case, repeat: int) -> list[float]:
        p = self.pair
        assert p is not None
        times = []
        for _ in range(repeat):
            took, moved = self.transfers([p.src_ids], [p.dst_ids])
            if moved != [case.nbytes, case.nbytes]:
                raise RuntimeError(f"{self.name}: moved {moved} bytes; expected {case.nbytes}")
            times.append(took)
        return times

    def many(self, repeat: int) -> list[float]:
        p = self.pair
        assert p is not None
        times = []
        for _ in range(repeat):
            took, moved = self.transfers([[s] for s in p.src_ids], [[d] for d in p.dst_ids])
            if any(n != MANY.block for n in moved):
                raise RuntimeError(f"{self.name} many: moved {sorted(set(moved))} bytes")
            times.append(took)
        return times

    def free(self, case: Case) -> None:
        if self.pair is not None:
            self.pair = None
            self.f.unmap("a", self.regions[0])
            self.f.unmap(self.f.receiver, self.regions[1])


class GpuRawSystem(InProcessPair):
    """The copy alone on one GPU, in this process: ``dst.copy_(src)`` for a contiguous case, one
    launch of kvd's gather/scatter kernel (``kvd.transport.gpu_copy``, block maps made
    once per case) for the paged case; each transfer timed from the launch to
    ``torch.cuda.synchronize()``."""

    name = "raw"

    def __init__(self) -> None:
        self.pair: TensorPair | None = None
        self.maps: tuple[Any, Any] | None = None

    def start(self) -> None:
        import torch

        from kvd.transport import gpu_copy

        if not gpu_copy.available():
            raise Skip("kvd's gather/scatter kernel is not usable here (no triton)")
        gpu_copy.warm_up(torch.device("cuda", 0))  # compiled, and launched as kvd does

    def setup(self, case: Case) -> None:
        import torch

        from kvd.transport.gpu_copy import BlockMap

        self.pair = p = TensorPair(case, "cuda")
        if case.kind == "paged":
            device = p.src[0].device
            self.maps = (BlockMap(p.src, np.array(p.src_ids), device),
                         BlockMap(p.dst, np.array(p.dst_ids), device))
            torch.cuda.synchronize()

    def tensors(self) -> TensorPair:
        assert self.pair is not None
        return self.pair

    def time(self, case: Case, repeat: int) -> list[float]:
        import torch

        from kvd.transport import gpu_copy

        p = self.pair
        assert p is not None
        times = []
        for _ in range(repeat):
            t0 = now()
            if self.maps is not None:
                reader, writer = self.maps
                gpu_copy.copy(0, reader.pieces(), src=reader, dst=writer)
            else:
                p.dst[0].copy_(p.src[0])
            torch.cuda.synchronize()
            times.append(now() - t0)
        return times

    def free(self, case: Case) -> None:
        self.pair, self.maps = None, None


# ------------------------------------------------------------------ the run


def installed(name: str) -> str:
    """'' when install_peers.sh recorded the system installed, else why not."""
    try:
        with open(PEERS_STATUS, encoding="utf-8") as f:
            for line in f:
                if line.startswith(f"{name}: "):
                    status = line.split(": ", 1)[1].strip()
                    return "" if status == "ok" else status
    except OSError:
        pass
    return f"not installed here (run benchmarks/install_peers.sh; no {PEERS_STATUS})"


def make_systems(names: list[str], root: str) -> tuple[list[System], KvdDaemons,
                                                       FloorDaemons]:
    daemons, floor = KvdDaemons(root), FloorDaemons(root)
    out: list[System] = []
    for name in names:
        if name == "raw":
            out.append(WorkerSystem("raw", {}, root))
        elif name in ("floor", "floor-pull"):
            out.append(FloorSystem(name, floor))
        elif name in ("kvd-put", "kvd-pull"):
            out.append(KvdSystem(name, daemons))
        elif name == "nixl":
            out.append(WorkerSystem("nixl", {"UCX_TLS": "tcp"}, root))
        elif name == "mooncake":
            # (glog: warnings and up; it logs every batch at INFO)
            out.append(WorkerSystem("mooncake", {"GLOG_minloglevel": "1"}, root))
    return out, daemons, floor


class Run:
    def __init__(self, systems: list[System], rounds: int, repeat: int, log: Callable[[str], None]
                 ) -> None:
        self.systems = systems
        self.rounds, self.repeat, self.log = rounds, repeat, log
        self.skipped: dict[str, str] = {}
        self.times: dict[str, dict[str, list[float]]] = {s.name: {} for s in systems}
        self.checks: dict[str, dict[str, bool]] = {s.name: {} for s in systems}
        # per system: CPU seconds its processes spent in the ``many`` rounds, and its
        # clients in this process (``System.client_cpu_s``: kvd's and the floor's)
        self.many_cpu_s: dict[str, float] = {}
        self.many_client_cpu_s: dict[str, float] = {}

    def live(self) -> list[System]:
        return [s for s in self.systems if s.name not in self.skipped]

    def drop(self, s: System, why: str) -> None:
        self.skipped[s.name] = why
        self.log(f"  skipping {s.name}: {why}")
        with contextlib.suppress(Exception):
            s.stop()

    def start(self) -> None:
        for s in self.systems:
            if s.name in ("nixl", "mooncake") and installed(s.name) and not importable(s.name):
                self.drop(s, installed(s.name))
                continue
            try:
                s.start()
                s.pause()
            except Exception as exc:
                self.drop(s, str(exc) if isinstance(exc, Skip) else repr(exc))

    def case(self, case: Case, seed: int) -> None:
        self.log(f"{case.label}: {', '.join(s.name for s in self.live())}")
        ready: list[System] = []
        for s in self.live():
            s.resume()
            try:
                s.setup(case)
                s.verify(case, seed, move=True)
                s.clear()  # the timed transfers must deliver the bytes again
                ready.append(s)
            except Exception as exc:
                self.drop(s, f"{case.label}: {exc}")
            finally:
                s.pause()
        repeat = repeat_for(case, self.repeat)
        for r in range(self.rounds):
            order = ready[r % len(ready):] + ready[:r % len(ready)] if ready else []
            for s in order:
                if s.name in self.skipped:
                    continue
                s.resume()
                try:
                    cpu0 = cpu_seconds(s.procs())
                    s.client_cpu_s = 0.0
                    got = s.many(self.repeat) if case is MANY else s.time(case, repeat)
                    if case is MANY:
                        self.many_cpu_s[s.name] = (self.many_cpu_s.get(s.name, 0.0)
                                                   + cpu_seconds(s.procs()) - cpu0)
                        if s.client_cpu_s:
                            self.many_client_cpu_s[s.name] = (
                                self.many_client_cpu_s.get(s.name, 0.0) + s.client_cpu_s)
                    self.times[s.name].setdefault(case.label, []).extend(got)
                except Exception as exc:
                    self.drop(s, f"{case.label}: {exc}")
                finally:
                    s.pause()
        for s in ready:
            if s.name in self.skipped:
                continue
            s.resume()
            try:
                s.verify(case, seed, move=False)
                self.checks[s.name][case.label] = True
                s.free(case)
            except Exception as exc:
                self.checks[s.name][case.label] = False
                self.drop(s, f"{case.label}: after the timed transfers: {exc}")
            finally:
                s.pause()


def repeat_for(case: Case, repeat: int) -> int:
    """Transfers per round: ``repeat`` up to 1 MiB, fewer for bulk (16 MiB's worth of
    the base count, at least 2) so that a round of 1 GiB stays within seconds."""
    if case.nbytes <= MiB:
        return repeat
    return max(2, repeat * 16 * MiB // case.nbytes)


def importable(name: str) -> bool:
    module = {"nixl": "import nixl._api\n", "mooncake": "import mooncake.engine\n"}[name]
    if name == "nixl":
        module = ("import importlib.util as u\nassert any(u.find_spec(m) for m in "
                  "('nixl', 'nixl_cu12', 'nixl_cu13'))\n")
    return subprocess.run([sys.executable, "-c", module], capture_output=True,
                          timeout=120).returncode == 0


def cpu_seconds(procs: list[subprocess.Popen[bytes]]) -> float:
    """CPU time (user + system, all threads) of ``procs`` so far. (The clients that run
    in this process count apart: ``client_cpu_s``.) Read per thread in nanoseconds
    (``schedstat``): ``stat``'s 10 ms ticks read 0 for a quick run's few transfers."""
    total = 0
    for p in procs:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p.pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError), open(
                        f"/proc/{p.pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
    return total / 1e9


def client_cpu_s() -> float:
    """CPU seconds so far of this process's client threads: the main thread, which makes
    every client call, and ZeroMQ's I/O threads (``ZMQbg/...``), which carry them. Not
    torch's OpenMP threads, which the harness's own tensor work (or an import) may leave
    spinning: they are not the clients'. Per thread from ``schedstat`` (nanoseconds)."""
    total = 0
    pid = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        try:
            if int(tid) != pid:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if not f.read().startswith("ZMQbg"):
                        continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # (a thread that just ended)
            continue
    return total / 1e9


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def figures(run: Run, cases: list[Case]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, per_case in run.times.items():
        for case in cases:
            times = per_case.get(case.label)
            if not times or not run.checks[name].get(case.label):
                continue  # (a case whose bytes were not checked after timing reports nothing)
            p = f"{name}_{case.label}"
            if case is MANY:
                rate = [MANY.pick / t for t in times]
                out.update({f"{p}_best_per_s": round(max(rate)),
                            f"{p}_median_per_s": round(statistics.median(rate)),
                            f"{p}_p90_per_s": round(percentile(rate, 10))})
                transfers = len(times) * MANY.pick
                if name in run.many_cpu_s:
                    procs = run.many_cpu_s[name]
                    client = run.many_client_cpu_s.get(name)
                    out[f"{p}_cpu_us_per_transfer"] = round(
                        (procs + (client or 0.0)) / transfers * 1e6, 1)
                    if client is not None:  # its processes are daemons; its clients, here
                        out[f"{p}_daemon_cpu_us_per_transfer"] = round(
                            procs / transfers * 1e6, 1)
                        out[f"{p}_client_cpu_us_per_transfer"] = round(
                            client / transfers * 1e6, 1)
                continue
            best, p50, p90 = min(times), statistics.median(times), percentile(times, 90)
            out.update({f"{p}_best_us": round(best * 1e6, 1), f"{p}_p50_us": round(p50 * 1e6, 1),
                        f"{p}_median_us": round(p50 * 1e6, 1), f"{p}_p90_us": round(p90 * 1e6, 1),
                        f"{p}_best_gbps": round(case.nbytes / best / 1e9, 3),
                        f"{p}_median_gbps": round(case.nbytes / p50 / 1e9, 3),
                        f"{p}_p90_gbps": round(case.nbytes / p90 / 1e9, 3),
                        f"{p}_n": len(times)})
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def figure_of(label: str) -> str:
    """The figure a case's ratios compare: a time for latency (kvd's over theirs: lower
    is better), a rate for the others (kvd's over theirs: higher is better)."""
    if label in LATENCY_LABELS:
        return "p50_us"
    return "median_per_s" if label == "many" else "median_gbps"


def vs(f: dict[str, Any], a: str, b: str, label: str) -> float | None:
    """System ``a``'s figure of case ``label`` over ``b``'s (None if either is missing)."""
    key = figure_of(label)
    return ratio(f.get(f"{a}_{label}_{key}"), f.get(f"{b}_{label}_{key}"))


def by_case(f: dict[str, Any], cases: list[Case], names: list[str]) -> dict[str, Any]:
    """Per kvd system and case, its ratio to its floor, to raw, to NIXL and to Mooncake."""
    out: dict[str, Any] = {}
    for kvd in (n for n in names if n in FLOORS):
        out[kvd] = {c.label: {"floor": vs(f, kvd, FLOORS[kvd], c.label),
                              **{p: vs(f, kvd, p, c.label) for p in ("raw", "nixl", "mooncake")}}
                    for c in cases}
    return out


def ratios(f: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kvd, suffix in (("kvd-put", ""), ("kvd-pull", "_pull")):
        floor = FLOORS[kvd]
        for key, label in (("lat_4k", "4KiB"), ("lat_1m", "1MiB"), ("bulk_64m", "64MiB"),
                           ("bulk_1g", "1GiB"), ("paged", "paged"), ("many", "many")):
            out[f"{key}_vs_floor{suffix}"] = vs(f, kvd, floor, label)
        out[f"bulk_64m_vs_raw{suffix}"] = vs(f, kvd, "raw", "64MiB")
        out[f"daemon_cpu_us_many{suffix}"] = f.get(f"{kvd}_many_daemon_cpu_us_per_transfer")
        out[f"client_cpu_us_many{suffix}"] = f.get(f"{kvd}_many_client_cpu_us_per_transfer")
        out[f"lat_4k_vs_nixl{suffix}"] = ratio(f.get(f"{kvd}_4KiB_p50_us"),
                                               f.get("nixl_4KiB_p50_us"))
        out[f"lat_1m_vs_nixl{suffix}"] = ratio(f.get(f"{kvd}_1MiB_p50_us"),
                                               f.get("nixl_1MiB_p50_us"))
        peers = {p: f[f"{p}_64MiB_median_gbps"] for p in ("nixl", "mooncake")
                 if f"{p}_64MiB_median_gbps" in f}
        best = max(peers, key=lambda p: peers[p]) if peers else None
        out[f"bulk_64m_vs_best_peer{suffix}"] = ratio(
            f.get(f"{kvd}_64MiB_median_gbps"), peers[best] if best else None)
        out["bulk_64m_best_peer"] = best
        out[f"many_vs_nixl{suffix}"] = ratio(f.get(f"{kvd}_many_median_per_s"),
                                             f.get("nixl_many_median_per_s"))
    return out


def machine() -> dict[str, Any]:
    """The machine, as benchmarks/tcp_transfer.py describes it, and its load now."""
    return {**tcp_transfer.machine(), "load_1m": round(os.getloadavg()[0], 2)}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gbps(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"  # (a GPU's fit the column)


def table(run: Run, cases: list[Case], f: dict[str, Any]) -> None:
    names = [s.name for s in run.systems]
    print(f"\n{'case':<8}" + "".join(f"{n:>22}" for n in names))
    for case in cases:
        if case is MANY:
            unit, cells = "transfers/s (best / median / p90)", []
            for n in names:
                k = f"{n}_many"
                cells.append(f"{f[k + '_best_per_s']:,} / {f[k + '_median_per_s']:,}"
                             if k + "_best_per_s" in f else "-")
            print(f"{'many':<8}" + "".join(f"{c:>22}" for c in cells) + f"   {unit}")
            cells = [f"{f[k]:,.0f}" if (k := f"{n}_many_cpu_us_per_transfer") in f else "-"
                     for n in names]
            print(f"{'cpu':<8}" + "".join(f"{c:>22}" for c in cells)
                  + "   µs of CPU per transfer in many (all its processes)")
            continue
        lat = case.label in LATENCY_LABELS
        cells = []
        for n in names:
            k = f"{n}_{case.label}"
            if f"{k}_best_us" not in f:
                cells.append("-")
            elif lat:
                cells.append(f"{f[k + '_best_us']:.0f} / {f[k + '_p50_us']:.0f} / "
                             f"{f[k + '_p90_us']:.0f}")
            else:
                cells.append(" / ".join(gbps(f[f"{k}_{s}_gbps"]) for s in ("best", "median",
                                                                           "p90")))
        unit = "µs best / p50 / p90" if lat else "GB/s best / median / p90"
        print(f"{case.label:<8}" + "".join(f"{c:>22}" for c in cells) + f"   {unit}")


def ratio_table(per: dict[str, Any]) -> None:
    """kvd's ratios per case: its time over theirs for latency (lower is better), its
    rate over theirs for bandwidth and many (higher is better)."""
    for kvd, rows in per.items():
        print(f"\n{kvd + ' over':<12}" + "".join(f"{p:>10}" for p in ("floor", "raw", "nixl",
                                                                        "mooncake"))
              + "   (latency: time over theirs; GB/s and many: rate over theirs)")
        for label, cells in rows.items():
            print(f"{label:<12}" + "".join("         -" if v is None else f"{v:>10.2f}"
                                          for v in cells.values()))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(systems: list[System], shared: list[KvdDaemons | FloorDaemons],
            cases: list[Case], root: str, args: argparse.Namespace) -> Run:
    """Every case on every system that starts, alternated; everything stopped after
    (``shared``: the daemons systems share, closed last)."""
    run = Run(systems, args.rounds, args.repeat, log)
    try:
        run.start()
        for i, case in enumerate(cases):
            if run.live():
                run.case(case, seed=1000 + i)
    finally:
        for s in systems:
            with contextlib.suppress(Exception):
                s.stop()
        for daemons in shared:
            daemons.close()
        CHILDREN.stop_all()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return run


def report(run: Run, cases: list[Case], names: list[str], args: argparse.Namespace,
           host: dict[str, Any], f: dict[str, Any], found: dict[str, Any], note: str,
           title: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "device": args.device, "machine": host, "rounds": args.rounds, "repeat": args.repeat,
        "cases": [c.label for c in cases], "systems": names, "skipped": run.skipped,
        "checks": run.checks, "note": note or None,
        "checks_passed": all(all(v.values()) for v in run.checks.values()),
        "ratios_by_case": by_case(f, cases, names), **f, **found}
    print(f"{title}; {args.rounds} rounds x {args.repeat} per system and case, systems "
          "alternated, idle ones paused")
    print(f"machine: {host['node']}, {host['cpu_model']}, {host['cpus']} CPUs, load "
          f"{host['load_1m']}, Python {host['python']}, Linux {host['kernel']}"
          + (f", {host['gpu']}" if host.get("gpu") else ""))
    table(run, cases, f)
    for n, why in run.skipped.items():
        print(f"skipped {n}: {why}")
    if note:
        print(note)
    print("byte checks: " + ("all passed" if out["checks_passed"] else f"FAILED {run.checks}"))
    ratio_table(out["ratios_by_case"])
    print("ratios: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    return out


def system_names(args: argparse.Namespace, known: tuple[str, ...]) -> list[str]:
    """The systems asked for; on the CPU ``floor`` brings the floor of both kvd flows
    (``floor``, ``floor-pull``)."""
    names = [n.strip() for n in (args.systems or ",".join(known)).split(",") if n.strip()]
    unknown = set(names) - set(known)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)} for --device {args.device}; "
                         f"known: {', '.join(known)}")
    if "floor" in names and "floor-pull" in known and "floor-pull" not in names:
        names.insert(names.index("floor") + 1, "floor-pull")
    return names


def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    names = system_names(args, SYSTEMS)
    cases = [Case.contig("4KiB", 4 * KiB), Case.contig("1MiB", MiB)]
    if not args.quick:
        cases.append(Case.contig("64MiB", 64 * MiB))
    note = ""
    if args.full:
        cases.append(Case.contig("1GiB", GiB))
    elif not args.quick:
        need = 2 * GiB * len(names) + 4 * GiB
        if mem_available() >= need:
            cases.append(Case.contig("1GiB", GiB))
        else:
            note = (f"1GiB left out: {mem_available() / GiB:.1f} GiB available, "
                    f"{need / GiB:.0f} wanted (--full runs it anyway)")
    if not args.quick:
        cases.append(PAGED)
    cases.append(MANY)

    root = tempfile.mkdtemp(prefix="kvd-peers-", dir="/tmp")
    systems, daemons, floor = make_systems(names, root)
    run = measure(systems, [daemons, floor], cases, root, args)
    f = figures(run, cases)
    found = {**ratios(f), "gc_longest_pause_ms": daemons.gc_longest_pause_ms}
    return report(run, cases, names, args, machine(), f, found, note,
                  "kvd beside its peers, CPU, two processes on loopback")


GPU_SYSTEMS = ("raw", "floor", "kvd-put", "nixl")
GPU_RATIOS = ("gpu_lat_1m_vs_floor", "gpu_lat_1m_vs_nixl", "gpu_contig_vs_floor",
              "gpu_contig_vs_raw", "gpu_contig_vs_nixl", "gpu_paged_vs_floor",
              "gpu_paged_vs_raw", "gpu_paged_vs_nixl")


def gpu_ratios(f: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, label in (("gpu_lat_1m", "1MiB"), ("gpu_contig", "512MiB"),
                       ("gpu_paged", "paged")):
        for peer in ("floor", "raw", "nixl"):
            out[f"{key}_vs_{peer}"] = vs(f, "kvd-put", peer, label)
    return {k: out[k] for k in GPU_RATIOS}


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    """One GPU: kvd's local path (one daemon; a put into a get waiting there, both regions
    registered by CUDA IPC) against its floor (``FloorSystem``: the same path, one launch
    and an event poll in a floor daemon), NIXL VRAM -> VRAM between two processes (its UCX
    backend: cuda_ipc) and the raw copy (``GpuRawSystem``), on contiguous 1 MiB and
    512 MiB and the paged case (64 tensors x 256 random blocks of 32 KiB). The ratios: kvd
    1 MiB p50 over the floor's and NIXL's, kvd contiguous 512 MiB and paged median GB/s
    over the floor's, the raw copy's and NIXL's."""
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(f"--device cuda needs torch with CUDA: {exc}") from None
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is "
                         "False); run it on a GPU machine, or use --device cpu")
    names = system_names(args, GPU_SYSTEMS)
    cases = [Case.contig("1MiB", MiB)]
    if not args.quick:
        cases += [Case.contig("512MiB", 512 * MiB), PAGED]
    root = tempfile.mkdtemp(prefix="kvd-peers-", dir="/tmp")
    daemons, floor = KvdDaemons(root, "cuda"), FloorDaemons(root, "cuda")
    systems: list[System] = []
    for name in names:
        if name == "raw":
            systems.append(GpuRawSystem())
        elif name == "floor":
            systems.append(FloorSystem(name, floor))
        elif name == "kvd-put":
            systems.append(KvdSystem(name, daemons))
        else:
            systems.append(WorkerSystem("nixl", {"PEERS_DEVICE": "cuda"}, root))
    run = measure(systems, [daemons, floor], cases, root, args)
    f = figures(run, cases)
    host = {**machine(), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    found = {**gpu_ratios(f), "gc_longest_pause_ms": daemons.gc_longest_pause_ms}
    return report(run, cases, names, args, host, f, found, "",
                  "kvd beside its peers, one GPU, two processes (kvd: one daemon)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--quick", action="store_true",
                    help="4KiB, 1MiB and many only, 2 rounds of 3 (a smoke run)")
    ap.add_argument("--full", action="store_true", help="1GiB whatever memory is available")
    ap.add_argument("--systems",
                    help=f"comma-separated; CPU: {', '.join(SYSTEMS)} (all by default; "
                         f"floor brings floor-pull too); cuda: {', '.join(GPU_SYSTEMS)} "
                         "(all by default)")
    ap.add_argument("--rounds", type=int, help="rounds per case (default 5; --quick 2)")
    ap.add_argument("--repeat", type=int,
                    help="transfers per system per round (default 20; --quick 3)")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.repeat = args.repeat or (3 if args.quick else 20)
    if args.rounds < 1 or args.repeat < 1:
        ap.error("--rounds and --repeat must be at least 1")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    try:
        out = gpu_main(args) if args.device == "cuda" else cpu_main(args)
    except SystemExit as exc:
        if args.json and isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            print(json.dumps({"error": exc.code, "device": args.device,
                              **dict.fromkeys(GPU_RATIOS)}))
            return 2
        raise
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
