"""CPU tensors the daemon can map: allocated in shared-memory segments by the client library.

``shared_empty`` creates a *segment*: an anonymous shared-memory file (``memfd_create``,
named ``kvd-<pid>-<n>``) sealed against shrinking and growing, maps it, and returns a
tensor on that mapping. The library remembers which segment each tensor's storage lives
in, so ``register`` can describe a tensor (or any view of one) to the daemon as (segment,
byte offset, shape, stride, dtype); the segment itself goes to the daemon as a file
descriptor, once per session, over the client's lifeline (``client/lifeline.py``). A CPU
tensor that is not in such a segment cannot be shared and is refused with a message that
says how to allocate it.

Why memfds and not named files in /dev/shm: a file can be truncated by whoever may write
it, and a daemon touching a truncated mapping dies of SIGBUS (every client with it);
a sealed segment cannot shrink. Nothing is left behind either: a segment goes when the
last process holding it (by descriptor or mapping) lets go, client crash included, and
no file permissions or shared /dev/shm are needed for the daemon to map it.
"""

from __future__ import annotations

import fcntl
import itertools
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from kvd.errors import BadRequest
from kvd.protocol import (
    SHM_PREFIX,
    CudaIpcTensor,
    DType,
    ShmTensor,
)

if TYPE_CHECKING:
    import torch

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(frozen=True)
class Segment:
    id: int  # unique in this process, never reused
    fd: int  # open for as long as the mapping lives: it is what the daemon is handed
    nbytes: int


# Reentrant: ``_forget`` runs from a finalizer, that is wherever the garbage collector
# happens to run, which may be inside a ``with _lock`` of this same thread (an allocation
# there collects a cycle that held another segment's mapping).
_lock = threading.RLock()
_counter = itertools.count(1)
# storage data_ptr -> its segment, and id -> segment; entries leave when the mapping is
# collected.
_segments: dict[int, Segment] = {}
_by_id: dict[int, Segment] = {}


def _forget(ptr: int, seg_id: int, fd: int) -> None:
    with _lock:
        _segments.pop(ptr, None)
        _by_id.pop(seg_id, None)
    os.close(fd)


def shared_empty(shape: Sequence[int] | int, dtype: Any = None) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory that a kvd daemon can map."""
    import torch

    dtype = dtype or torch.float16
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(d < 0 for d in dims):
        raise BadRequest(f"negative dimension in shape {dims}")
    numel = math.prod(dims)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = max(numel * itemsize, 1)
    seg_id = next(_counter)
    fd = os.memfd_create(f"{SHM_PREFIX}{os.getpid()}-{seg_id}",
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    base = torch.frombuffer(mm, dtype=torch.uint8)
    ptr = base.untyped_storage().data_ptr()
    seg = Segment(seg_id, fd, nbytes)
    with _lock:
        _segments[ptr] = _by_id[seg_id] = seg
    # The mmap lives as long as any tensor on it; when it goes, so does our descriptor
    # (the daemon holds its own for as long as it maps the segment).
    weakref.finalize(mm, _forget, ptr, seg_id, fd)
    return base[: numel * itemsize].view(dtype).view(dims)


def shared_zeros(shape: Sequence[int] | int, dtype: Any = None) -> torch.Tensor:
    return shared_empty(shape, dtype).zero_()


def segment_of(spec: ShmTensor) -> Segment:
    """The segment a spec from ``tensor_spec`` (of this process) names."""
    with _lock:
        seg = _by_id.get(spec.segment)
    if seg is None:
        raise BadRequest(f"segment {spec.segment} is gone (its tensors were freed)")
    return seg


def _dtype_name(dtype: Any, index: int) -> Any:
    name = str(dtype).removeprefix("torch.")
    if name not in get_args(DType):
        raise BadRequest(f"tensor {index} has dtype {name}, which kvd does not move")
    return name


_ready_events: dict[int, Any] = {}  # GPU index -> this process's interprocess event


def _ready_event(device: int) -> Any:
    import torch

    with _lock:
        event = _ready_events.get(device)
        if event is None:
            with torch.cuda.device(device):
                event = _ready_events[device] = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))  # a handle needs a record
        return event


def mark_ready(gpus: Sequence[int]) -> None:
    """Before a request that makes the daemon read GPU blocks: record this process's
    interprocess event on each GPU's current stream, so the daemon's reads come after the
    writes queued so far (the daemon's stream waits for the event; nobody synchronises)."""
    import torch

    from kvd.memory.streams import current_stream

    for device in gpus:
        _ready_event(device).record(current_stream(torch.device("cuda", device)))


def cuda_tensor_spec(tensor: torch.Tensor, index: int = 0) -> CudaIpcTensor:
    """What torch's ``reduce_tensor`` would pickle, as plain fields: the daemon rebuilds the
    tensor with ``rebuild_cuda_tensor``. The storage must come from torch's caching
    allocator (a custom allocator's memory cannot be exported)."""
    import torch

    storage = tensor._typed_storage()
    try:
        (_device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
    except RuntimeError as exc:
        raise BadRequest(f"tensor {index} on {tensor.device} cannot be shared through CUDA "
                         f"IPC: {exc}") from None
    return CudaIpcTensor(
        gpu_uuid=str(torch.cuda.get_device_properties(tensor.device).uuid),
        handle=bytes(handle), storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes), ref_counter_handle=bytes(ref_handle or b""),
        ref_counter_offset=int(ref_offset or 0), event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync), tensor_offset=int(tensor.storage_offset()),
        shape=list(tensor.shape), stride=list(tensor.stride()),
        dtype=_dtype_name(tensor.dtype, index),
        ready_event=bytes(_ready_event(tensor.device.index).ipc_handle()))


def tensor_spec(tensor: torch.Tensor, index: int = 0) -> ShmTensor | CudaIpcTensor:
    """Describe a shared CPU tensor for ``Register``; refuse anything else clearly."""
    if tensor.device.type == "cuda":
        return cuda_tensor_spec(tensor, index)
    if tensor.device.type != "cpu":
        raise BadRequest(f"tensor {index} is on {tensor.device}, which kvd cannot map")
    storage = tensor.untyped_storage()
    with _lock:
        seg = _segments.get(storage.data_ptr())
    if seg is None:
        raise BadRequest(
            f"tensor {index} is not in shared memory the daemon can map: allocate it with "
            "kvd.shared_empty(shape, dtype) (or kvd.shared_zeros)"
        )
    return ShmTensor(
        segment=seg.id,
        file_bytes=seg.nbytes,
        offset_bytes=tensor.data_ptr() - storage.data_ptr(),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        dtype=_dtype_name(tensor.dtype, index),
    )
