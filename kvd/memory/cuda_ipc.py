"""CUDA tensors of another process, opened through CUDA IPC (torch's own mechanism).

The client sends the fields of torch's ``reduce_tensor`` as plain data
(``protocol.CudaIpcTensor``); here they are handed to ``rebuild_cuda_tensor``, once per
registration. The device is found by GPU UUID, so daemon and client may see different
``CUDA_VISIBLE_DEVICES``. torch is imported, and CUDA initialised, only when a client
registers a GPU tensor: a CPU-only daemon never touches CUDA.

torch trusts these fields (they normally come from another torch process), kvd does not:
torch's release of the mapping decrements an int64 at ``ref_counter_offset`` in the
shared-memory file the spec names, unchecked, so that is checked here first. (Not yet
checked: that the storage lies inside the allocation the handle opens; an offset or size
past it would have the daemon's kernels read and write outside it. The check, through
``cuMemGetAddressRange``, waits on branch ``next/ipc-bounds`` for a GPU run.)
"""

from __future__ import annotations

import os
import stat

import torch

from kvd.errors import BadRequest
from kvd.protocol import CudaIpcTensor

# torch's CUDA_IPC_REF_COUNTER_FILE_SIZE (CudaIPCTypes.h): int64 counters per file, which
# torch maps whole whatever the file's size.
REF_COUNTERS_PER_FILE = 10000
_SHM_DIR = "/dev/shm"  # where shm_open names live on Linux (glibc)


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
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(spec.shape), tuple(spec.stride), spec.tensor_offset,
            torch.storage.TypedStorage, dtype, device, spec.handle, spec.storage_size_bytes,
            spec.storage_offset_bytes, False, spec.ref_counter_handle,
            spec.ref_counter_offset, spec.event_handle or None, spec.event_sync_required)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise BadRequest(f"cannot open the CUDA IPC handle of a tensor on GPU "
                         f"{spec.gpu_uuid}: {exc}") from None


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
        (stream or torch.cuda.current_stream(device)).wait_event(event)
