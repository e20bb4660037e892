"""One side of a library system (raw sockets, NIXL, Mooncake TE) in its own process.

Run by benchmarks/peers.py as ``python workers.py SYSTEM ROLE`` (ROLE: target, the side
whose buffer the bytes land in, or initiator, the side that moves them and times it). It
reads one JSON command a line on stdin and answers one JSON line on stdout:

  setup {case, peer}   allocate and register this side's buffer for the case (the
                       initiator also connects to the target, whose setup answer is peer)
  fill {seed}          initiator: write the pattern of seed into the source
  zero                 target: clear the destination
  check {seed}         target: whether every piece holds the pattern of seed ("error")
  time {repeat}        initiator: seconds of each of repeat whole-case transfers
  many {repeat}        initiator: seconds of each of repeat rounds of one transfer per
                       piece, all in flight at once
  free                 drop the case's buffers and registrations

An error answers {"error": ...}; stdin closing ends the process.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import Case, check, fill

now = time.perf_counter
IO_TIMEOUT_S = 120.0
IOV_MAX = 1000  # pieces per sendmsg/recvmsg_into, under Linux's 1024
MOONCAKE_BATCH = 1024  # entries per batch write (2,048 worked, 4,096 did not, here)


def address(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


class Side:
    """What every system's side does with its buffer; subclasses move the bytes. The
    buffer is host memory, or with ``PEERS_DEVICE=cuda`` in the environment a uint8 tensor
    on the process's current GPU (``gpu``; ``buf`` is then empty and ``base`` its
    address)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.case: Case | None = None
        self.buf = np.zeros(0, np.uint8)
        self.gpu: Any = None  # torch.Tensor on the GPU, under PEERS_DEVICE=cuda
        self.on_gpu = os.environ.get("PEERS_DEVICE") == "cuda"

    @property
    def base(self) -> int:
        return int(self.gpu.data_ptr()) if self.gpu is not None else address(self.buf)

    @property
    def nbytes(self) -> int:
        return int(self.gpu.numel()) if self.gpu is not None else len(self.buf)

    def setup(self, case: Case, peer: dict[str, Any]) -> dict[str, Any]:
        self.case = case
        if self.on_gpu:
            import torch

            self.gpu = torch.zeros(case.side_bytes, dtype=torch.uint8, device="cuda")
        else:
            self.buf = np.zeros(case.side_bytes, np.uint8)
        return {"base": self.base}

    def fill(self, seed: int) -> dict[str, Any]:
        if self.gpu is not None:
            import torch

            pattern = np.empty(self.nbytes, np.uint8)
            fill(pattern, seed)
            self.gpu.copy_(torch.from_numpy(pattern))
            torch.cuda.synchronize()
        else:
            fill(self.buf, seed)
        return {}

    def zero(self) -> dict[str, Any]:
        if self.gpu is not None:
            import torch

            self.gpu.zero_()
            torch.cuda.synchronize()
        else:
            self.buf[:] = 0
        return {}

    def check(self, seed: int) -> dict[str, Any]:
        assert self.case is not None
        got = self.gpu.cpu().numpy() if self.gpu is not None else self.buf
        return {"error": check(self.case, got, seed) or None}

    def time(self, repeat: int) -> dict[str, Any]:
        raise NotImplementedError

    def many(self, repeat: int) -> dict[str, Any]:
        raise NotImplementedError

    def free(self) -> dict[str, Any]:
        self.case = None
        self.buf = np.zeros(0, np.uint8)
        self.gpu = None
        return {}

    def close(self) -> None:
        pass

    def views(self, offsets: np.ndarray, length: int) -> list[memoryview]:
        whole = memoryview(self.buf)
        return [whole[o:o + length] for o in offsets.tolist()]


# ------------------------------------------------------------------ raw sockets


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """All of ``views`` with ``sendmsg`` (scatter-gather, no copy in Python)."""
    i = 0
    while i < len(views):
        i = advance(views, i, sock.sendmsg(views[i:i + IOV_MAX]))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill all of ``views`` with ``recvmsg_into``; EOF before the last byte raises."""
    i = 0
    while i < len(views):
        got = sock.recvmsg_into(views[i:i + IOV_MAX])[0]
        if got == 0:
            raise EOFError("peer closed")
        i = advance(views, i, got)


def advance(views: list[memoryview], i: int, moved: int) -> int:
    """Past ``moved`` bytes from view ``i`` on: the index of the first view not yet done,
    which is cut to what is left of it."""
    while moved:
        if moved >= len(views[i]):
            moved -= len(views[i])
            i += 1
        else:
            views[i] = views[i][moved:]
            moved = 0
    return i


class RawSide(Side):
    """Plain TCP, one connection kept: the initiator sends an 8-byte header (-1: the whole
    case, else the index of one piece), then the pieces; the target receives them straight
    into its destination pieces and answers 1 byte."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.sock: socket.socket | None = None
        self.server: socket.socket | None = None
        self.receiver: threading.Thread | None = None
        self.failed = ""
        if role == "target":
            self.server = socket.create_server(("127.0.0.1", 0))
            self.server.settimeout(IO_TIMEOUT_S)

    def setup(self, case: Case, peer: dict[str, Any]) -> dict[str, Any]:
        out = super().setup(case, peer)
        s_off, d_off, length = case.pieces()
        if self.role == "target":
            self.dst_views = (d_off, length)
            if self.server is not None:
                out["port"] = self.server.getsockname()[1]
            if self.receiver is None:
                self.receiver = threading.Thread(target=self.serve, daemon=True)
                self.receiver.start()
        else:
            self.src = self.views(s_off, length)
            if self.sock is None:
                self.sock = socket.create_connection(("127.0.0.1", peer["port"]), IO_TIMEOUT_S)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return out

    def serve(self) -> None:
        assert self.server is not None
        try:
            sock, _ = self.server.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)  # the initiator's end closing ends it
            header = bytearray(8)
            while True:
                try:
                    recv_views(sock, [memoryview(header)])
                except EOFError:
                    return
                which = int.from_bytes(header, "little", signed=True)
                d_off, length = self.dst_views
                if which < 0:
                    recv_views(sock, self.views(d_off, length))
                else:
                    recv_views(sock, self.views(d_off[which:which + 1], length))
                sock.sendall(b"\x01")
        except BaseException as exc:  # told on the next check
            self.failed = repr(exc)

    def check(self, seed: int) -> dict[str, Any]:
        if self.failed:
            return {"error": f"raw receiver failed: {self.failed}"}
        return super().check(seed)

    def once(self) -> None:
        assert self.sock is not None
        send_views(self.sock, [memoryview((-1).to_bytes(8, "little", signed=True)),
                               *self.src])
        ack = bytearray(1)
        recv_views(self.sock, [memoryview(ack)])

    def time(self, repeat: int) -> dict[str, Any]:
        times = []
        for _ in range(repeat):
            t0 = now()
            self.once()
            times.append(now() - t0)
        return {"times": times}

    def many(self, repeat: int) -> dict[str, Any]:
        assert self.sock is not None
        times = []
        n = len(self.src)
        for _ in range(repeat):
            t0 = now()
            for i, view in enumerate(self.src):  # all sent before the first ack is read
                send_views(self.sock, [memoryview(i.to_bytes(8, "little", signed=True)), view])
            acks = bytearray(n)
            recv_views(self.sock, [memoryview(acks)])
            times.append(now() - t0)
        return {"times": times}

    def close(self) -> None:
        for s in (self.sock, self.server):
            if s is not None:
                s.close()


# ------------------------------------------------------------------ NIXL


def nixl_api() -> Any:
    """NIXL's Python API: the 'nixl' meta-package's module, else nixl-cu12's or
    nixl-cu13's own (the GPU host's CUDA 13 takes the latter)."""
    import importlib

    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            why = exc
    raise why


class NixlSide(Side):
    """A NIXL agent with the UCX backend (UCX_TLS from the environment), DRAM to DRAM, or
    VRAM to VRAM under ``PEERS_DEVICE=cuda`` (UCX's cuda_ipc between the two processes). The
    initiator prepares both descriptor lists and one WRITE handle per case (and one per
    piece for ``many``), then reposts the handles and polls them to DONE."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        api = nixl_api()
        # The target's progress thread is on (NIXL's default, as vLLM runs it): over UCX's
        # tcp transport nothing else progresses the passive side. The initiator's is off,
        # as one would tune it on a small machine: its own polling (check_xfer_state)
        # progresses its worker, and a second spinning thread only takes a core from it.
        conf = api.nixl_agent_config(enable_prog_thread=role == "target", backends=["UCX"])
        self.agent = api.nixl_agent(f"bench-{role}-{os.getpid()}", conf)
        self.memory = "VRAM" if self.on_gpu else "DRAM"  # device 0: the process's one GPU
        self.reg: Any = None
        self.remote = ""
        self.handles: list[Any] = []
        self.dlists: list[Any] = []

    def setup(self, case: Case, peer: dict[str, Any]) -> dict[str, Any]:
        out = super().setup(case, peer)
        self.reg = self.agent.register_memory([(self.base, self.nbytes, 0, "")], self.memory)
        if self.role == "target":
            out["md"] = base64.b64encode(self.agent.get_agent_metadata()).decode()
            return out
        if self.remote:  # its metadata now names the target's new buffer
            self.agent.remove_remote_agent(self.remote)
        self.remote = self.agent.add_remote_agent(base64.b64decode(peer["md"]))
        if isinstance(self.remote, bytes):
            self.remote = self.remote.decode()
        s_off, d_off, length = case.pieces()
        n = len(s_off)
        local = np.stack([s_off + self.base, np.full(n, length), np.zeros(n, np.int64)],
                         axis=1).astype(np.uint64)
        remote = np.stack([d_off + int(peer["base"]), np.full(n, length),
                           np.zeros(n, np.int64)], axis=1).astype(np.uint64)
        local_h = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self.memory)
        remote_h = self.agent.prep_xfer_dlist(self.remote, remote, self.memory)
        self.dlists = [local_h, remote_h]
        idx = np.arange(n, dtype=np.int32)
        self.whole = self.agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx)
        self.handles = [self.whole]
        self.pieces = n
        return out

    def post(self, handle: Any) -> None:
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in {state}")

    def time(self, repeat: int) -> dict[str, Any]:
        times = []
        for _ in range(repeat):
            t0 = now()
            self.post(self.whole)
            times.append(now() - t0)
        return {"times": times}

    def many(self, repeat: int) -> dict[str, Any]:
        local_h, remote_h = self.dlists
        singles = [self.agent.make_prepped_xfer("WRITE", local_h, np.array([i], np.int32),
                                                remote_h, np.array([i], np.int32))
                   for i in range(self.pieces)]
        self.handles.extend(singles)
        times = []
        for _ in range(repeat):
            t0 = now()
            pending = []
            for h in singles:
                state = self.agent.transfer(h)
                if state == "PROC":
                    pending.append(h)
                elif state != "DONE":
                    raise RuntimeError(f"NIXL transfer ended in {state}")
            while pending:
                still = []
                for h in pending:
                    state = self.agent.check_xfer_state(h)
                    if state == "PROC":
                        still.append(h)
                    elif state != "DONE":
                        raise RuntimeError(f"NIXL transfer ended in {state}")
                pending = still
            times.append(now() - t0)
        return {"times": times}

    def free(self) -> dict[str, Any]:
        for h in self.handles:
            self.agent.release_xfer_handle(h)
        for d in self.dlists:
            self.agent.release_dlist_handle(d)
        self.handles, self.dlists = [], []
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        return super().free()


# ------------------------------------------------------------------ Mooncake TE


class MooncakeSide(Side):
    """A Mooncake transfer engine with P2PHANDSHAKE metadata (no etcd) and the tcp
    protocol; the initiator writes with the synchronous batch call (one entry per piece),
    and ``many`` submits one asynchronous batch per piece and waits for all."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize failed")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.registered = 0

    def setup(self, case: Case, peer: dict[str, Any]) -> dict[str, Any]:
        out = super().setup(case, peer)
        if self.engine.register_memory(address(self.buf), len(self.buf)) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        self.registered = address(self.buf)
        if self.role == "target":
            out["session"] = self.session
            return out
        s_off, d_off, length = case.pieces()
        self.peer = peer["session"]
        self.src = (s_off + address(self.buf)).tolist()
        self.dst = (d_off + int(peer["base"])).tolist()
        self.lengths = [length] * len(self.src)
        return out

    def time(self, repeat: int) -> dict[str, Any]:
        times = []
        for _ in range(repeat):
            t0 = now()
            if len(self.src) == 1:
                rc = self.engine.transfer_sync_write(self.peer, self.src[0], self.dst[0],
                                                     self.lengths[0])
            else:  # in batches: one of more than ~2,000 entries returns -1
                rc = 0
                for i in range(0, len(self.src), MOONCAKE_BATCH):
                    rc = rc or self.engine.batch_transfer_sync_write(
                        self.peer, self.src[i:i + MOONCAKE_BATCH],
                        self.dst[i:i + MOONCAKE_BATCH], self.lengths[i:i + MOONCAKE_BATCH])
            times.append(now() - t0)
            if rc != 0:
                raise RuntimeError(f"Mooncake write returned {rc}")
        return {"times": times}

    def many(self, repeat: int) -> dict[str, Any]:
        times = []
        for _ in range(repeat):
            t0 = now()
            ids = [self.engine.batch_transfer_async_write(self.peer, [s], [d], [n])
                   for s, d, n in zip(self.src, self.dst, self.lengths, strict=True)]
            rc = self.engine.get_batch_transfer_status(ids)
            times.append(now() - t0)
            if rc != 0:
                raise RuntimeError(f"Mooncake batch status {rc}")
        return {"times": times}

    def free(self) -> dict[str, Any]:
        if self.registered:
            self.engine.unregister_memory(self.registered)
            self.registered = 0
        return super().free()


SIDES = {"raw": RawSide, "nixl": NixlSide, "mooncake": MooncakeSide}


def main() -> int:
    system, role = sys.argv[1], sys.argv[2]
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not mix with the answers
    try:
        side = SIDES[system](role)
    except BaseException as exc:
        out.write(json.dumps({"error": f"{system} {role} did not start: {exc!r}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            try:
                if op == "setup":
                    reply = side.setup(Case.from_json(cmd["case"]), cmd.get("peer") or {})
                elif op in ("fill", "check"):
                    reply = getattr(side, op)(int(cmd["seed"]))
                elif op in ("time", "many"):
                    reply = getattr(side, op)(int(cmd["repeat"]))
                elif op in ("zero", "free"):
                    reply = getattr(side, op)()
                else:
                    reply = {"error": f"unknown op {op!r}"}
            except Exception as exc:
                reply = {"error": f"{system} {role} {op}: {exc!r}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
