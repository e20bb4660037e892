"""CUDA tensors of another process, opened through CUDA IPC (torch's own mechanism).

The client sends the fields of torch's ``reduce_tensor`` as plain data
(``protocol.CudaIpcTensor``); here they are handed to ``rebuild_cuda_tensor``, once per
registration. The device is found by GPU UUID, so daemon and client may see different
``CUDA_VISIBLE_DEVICES``. torch is imported, and CUDA initialised, only when a client
registers a GPU tensor: a CPU-only daemon never touches CUDA.

torch trusts these fields (they normally come from another torch process), kvd does not:
torch's release of the mapping decrements an int64 at ``ref_counter_offset`` in the
shared-memory file the spec names, unchecked, so that is checked first; and it places the
storage at the spec's offset and size past the start of the allocation the handle opens,
unchecked, so that the storage lies inside that allocation is checked after, through the
driver's ``cuMemGetAddressRange`` (torch has no call for it), before any kernel of ours
reads or writes it. The view inside its storage torch checks itself (``set_``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
from typing import Any

import torch

from kvd.errors import BadRequest
from kvd.memory.streams import current_stream
from kvd.protocol import CudaIpcTensor

# torch's CUDA_IPC_REF_COUNTER_FILE_SIZE (CudaIPCTypes.h): int64 counters per file, which
# torch maps whole whatever the file's size.
REF_COUNTERS_PER_FILE = 10000
_SHM_DIR = "/dev/shm"  # where shm_open names live on Linux (glibc)
# Measured on the H200 host (driver 580): the daemon as one user opened a client's handle
# only when the client ran as that user too; a client of another user failed with "mapping
# of buffer object failed", with or without CAP_SYS_PTRACE for the daemon. (torch's
# reference-counter files, mode 0600, would stop it before that: checked first, with this.)
ONE_USER = (f"GPU clients must run as the daemon's user, uid {os.geteuid()}: CUDA IPC does "
            "not map memory between users")


def device_by_uuid(uuid: str) -> int:
    if not torch.cuda.is_available():
        raise BadRequest(f"GPU {uuid} is not visible to the daemon (it sees no CUDA device)")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise BadRequest(f"GPU {uuid} is not visible to the daemon (check its "
                     "CUDA_VISIBLE_DEVICES and the devices it is configured for)")


def open_cuda_tensor(spec: CudaIpcTensor, dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = device_by_uuid(spec.gpu_uuid)
    check_ref_counter(spec)
    try:
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(spec.shape), tuple(spec.stride), spec.tensor_offset,
            torch.storage.TypedStorage, dtype, device, spec.handle, spec.storage_size_bytes,
            spec.storage_offset_bytes, False, spec.ref_counter_handle,
            spec.ref_counter_offset, spec.event_handle or None, spec.event_sync_required)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise BadRequest(f"cannot open the CUDA IPC handle of a tensor on GPU "
                         f"{spec.gpu_uuid}: {exc} (where the client runs as another user than "
                         f"the daemon, this is why: {ONE_USER})") from None
    check_inside_allocation(tensor, device, spec)
    return tensor


def check_inside_allocation(tensor: torch.Tensor, device: int, spec: CudaIpcTensor) -> None:
    """The storage torch placed at ``storage_offset_bytes`` past the start of the mapping
    the handle opened must end inside that mapping. The range is asked for the mapping's
    start, not the storage's: an offset past the mapping could land in another allocation
    of ours (staging, a pool), whose range would then pass."""
    start = tensor.untyped_storage().data_ptr()
    mapping = start - spec.storage_offset_bytes
    base, size = allocation_range(device, mapping)
    if not (base <= mapping and start + spec.storage_size_bytes <= base + size):
        raise BadRequest(
            f"tensor storage of {spec.storage_size_bytes} bytes at offset "
            f"{spec.storage_offset_bytes} lies outside the {size - (mapping - base)}-byte "
            f"allocation its CUDA IPC handle opens (GPU {spec.gpu_uuid})")


class _Driver:
    """The few CUDA driver calls torch does not expose, through ctypes on libcuda (there
    wherever torch sees a GPU). Not through cuda-bindings as ``gpu_copy.peer_stores`` is:
    that is optional there (without it peer stores are off), while this check must run
    for every GPU registration, in any install."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        p, u64, i = ctypes.POINTER, ctypes.c_uint64, ctypes.c_int
        self.device_get = _fn(lib.cuDeviceGet, p(i), i)
        self.retain = _fn(lib.cuDevicePrimaryCtxRetain, p(ctypes.c_void_p), i)
        self.release = _fn(lib.cuDevicePrimaryCtxRelease_v2, i)
        self.push = _fn(lib.cuCtxPushCurrent_v2, ctypes.c_void_p)
        self.pop = _fn(lib.cuCtxPopCurrent_v2, p(ctypes.c_void_p))
        self.address_range = _fn(lib.cuMemGetAddressRange_v2, p(u64), p(ctypes.c_size_t), u64)


def _fn(f: Any, *argtypes: Any) -> Any:
    f.argtypes, f.restype = list(argtypes), ctypes.c_int
    return f


@functools.cache
def _driver() -> _Driver:
    return _Driver()


def allocation_range(device: int, address: int) -> tuple[int, int]:
    """(start, size) of the allocation holding ``address`` on GPU ``device`` (torch's
    index). The GPU's primary context is pushed for the call: the calling thread may have
    none current (a pool thread, when torch reused a handle it had opened and made no
    runtime call on it), and the driver then answers CUDA_ERROR_INVALID_CONTEXT."""
    drv = _driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(drv.device_get(ctypes.byref(dev), device), "cuDeviceGet")
    _check(drv.retain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(drv.push(ctx), "cuCtxPushCurrent")
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            err = drv.address_range(ctypes.byref(base), ctypes.byref(size), address)
        finally:
            _check(drv.pop(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
    finally:
        drv.release(dev)
    if err:
        raise BadRequest(f"GPU address {address:#x} of a CUDA IPC tensor is in no allocation "
                         f"(cuMemGetAddressRange: CUDA error {err})")
    return base.value, size.value


def _check(err: int, call: str) -> None:
    if err:
        raise RuntimeError(f"{call} failed: CUDA error {err}")


def check_ref_counter(spec: CudaIpcTensor) -> None:
    """The reference-counter file a spec names must be one torch could have made: a shm
    name, a regular file large enough for torch's mapping, an offset inside it."""
    if not spec.ref_counter_handle:
        raise BadRequest("a CUDA IPC tensor needs its reference-counter handle (as torch's "
                         "storage._share_cuda_() gives it)")
    if spec.ref_counter_offset >= REF_COUNTERS_PER_FILE:
        raise BadRequest(f"reference-counter offset {spec.ref_counter_offset} is past the "
                         f"{REF_COUNTERS_PER_FILE} counters of a file")
    try:
        name = spec.ref_counter_handle.decode("ascii")
    except UnicodeDecodeError:
        name = ""
    if (not name.startswith("/") or "/" in name[1:] or "\0" in name or name in ("/", "/.", "/..")
            or len(name) > 255):
        raise BadRequest(f"reference-counter handle {spec.ref_counter_handle[:64]!r} is not a "
                         "shared-memory name")
    try:
        st = os.stat(_SHM_DIR + name, follow_symlinks=False)
    except OSError as exc:
        raise BadRequest(f"reference-counter file {name!r}: {exc.strerror}") from None
    need = REF_COUNTERS_PER_FILE * 8
    if not stat.S_ISREG(st.st_mode) or st.st_size < need:
        raise BadRequest(f"reference-counter file {name!r} is not a regular file of at least "
                         f"{need} bytes")
    if not os.access(_SHM_DIR + name, os.R_OK | os.W_OK):
        raise BadRequest(
            f"the daemon (uid {os.geteuid()}) cannot open reference-counter file {name!r} "
            f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) read-write: {ONE_USER}")


def open_ready_event(spec: CudaIpcTensor) -> tuple[int, torch.cuda.Event] | None:
    """The client's interprocess event for the tensor's GPU (see ``CudaIpcTensor``)."""
    if not spec.ready_event:
        return None
    device = device_by_uuid(spec.gpu_uuid)
    try:
        return device, torch.cuda.Event.from_ipc_handle(device, spec.ready_event)
    except RuntimeError as exc:
        raise BadRequest(f"cannot open the client's CUDA event for GPU {spec.gpu_uuid}: "
                         f"{exc}") from None


def wait_ready(events: list[tuple[int, torch.cuda.Event]], stream: torch.cuda.Stream | None = None,
               ) -> None:
    """Make ``stream`` (default: each event's device's current stream) wait for what the
    clients recorded: their writes before the request that made us read."""
    for device, event in events:
        (stream or current_stream(device)).wait_event(event)
