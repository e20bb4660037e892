"""CPU tensors the daemon can map: allocated in shared-memory files by the client library.

``shared_empty`` creates a file ``kvd-<pid>-<n>-<random>`` in the shm directory, maps it,
and returns a tensor on that mapping. The library remembers which mapping each tensor's
storage lives in, so ``register`` can describe a tensor (or any view of one) to the daemon
as (file, byte offset, shape, stride, dtype). A CPU tensor that is not on such a mapping
cannot be shared and is refused with a message that says how to allocate it.

The file is unlinked when its last tensor is garbage-collected (or at exit); the daemon
keeps its own mapping, and unlinks the files of a client that dies without saying bye.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, get_args

from kvd.errors import BadRequest
from kvd.protocol import SHM_PREFIX, CudaIpcTensor, DType, ShmTensor, shm_dir

if TYPE_CHECKING:
    import torch

_lock = threading.Lock()
_counter = itertools.count()
# storage data_ptr -> (path, nbytes); entries leave when the mapping is collected.
_segments: dict[int, tuple[str, int]] = {}


def _forget(ptr: int, path: str) -> None:
    with _lock:
        _segments.pop(ptr, None)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def shared_empty(shape: Sequence[int] | int, dtype: Any = None) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory that a kvd daemon can map."""
    import torch

    dtype = dtype or torch.float16
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(d < 0 for d in dims):
        raise BadRequest(f"negative dimension in shape {dims}")
    numel = 1
    for d in dims:
        numel *= d
    nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
    name = f"{SHM_PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
    path = os.path.join(shm_dir(), name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o660)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    ptr = base.untyped_storage().data_ptr()
    with _lock:
        _segments[ptr] = (path, nbytes)
    # The mmap lives as long as any tensor on it; when it goes, so does the file.
    weakref.finalize(mm, _forget, ptr, path)
    return base[: numel * _itemsize(dtype)].view(dtype).view(dims)


def shared_zeros(shape: Sequence[int] | int, dtype: Any = None) -> torch.Tensor:
    t = shared_empty(shape, dtype)
    t.zero_()
    return t


def _itemsize(dtype: Any) -> int:
    import torch

    return int(torch.empty(0, dtype=dtype).element_size())


def share_with_daemon(paths: set[str], socket_path: str) -> None:
    """Let a daemon running as another user map these files: give them the group of the
    daemon's socket directory (``kvd`` under systemd) when we are a member of it, and mode
    0660 whatever our umask. Best effort: a daemon of the same user needs neither."""
    try:
        gid = os.stat(os.path.dirname(socket_path)).st_gid
    except OSError:
        return
    mine = gid == os.getegid() or gid in os.getgroups()
    for path in paths:
        with contextlib.suppress(OSError):
            if mine and os.stat(path).st_gid != gid:
                os.chown(path, -1, gid)
            os.chmod(path, 0o660)


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

    for device in gpus:
        _ready_event(device).record(torch.cuda.current_stream(device))


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
    path, nbytes = seg
    return ShmTensor(
        path=path,
        file_bytes=nbytes,
        offset_bytes=tensor.data_ptr() - storage.data_ptr(),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        dtype=_dtype_name(tensor.dtype, index),
    )
