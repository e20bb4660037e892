"""CUDA tensors of another process, opened through CUDA IPC (torch's own mechanism).

The client sends the fields of torch's ``reduce_tensor`` as plain data
(``protocol.CudaIpcTensor``); here they are handed to ``rebuild_cuda_tensor``, once per
registration. The device is found by GPU UUID, so daemon and client may see different
``CUDA_VISIBLE_DEVICES``. torch is imported, and CUDA initialised, only when a client
registers a GPU tensor: a CPU-only daemon never touches CUDA.
"""

from __future__ import annotations

import torch

from kvd.errors import BadRequest
from kvd.protocol import CudaIpcTensor


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
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(spec.shape), tuple(spec.stride), spec.tensor_offset,
            torch.storage.TypedStorage, dtype, device, spec.handle, spec.storage_size_bytes,
            spec.storage_offset_bytes, False, spec.ref_counter_handle or None,
            spec.ref_counter_offset, spec.event_handle or None, spec.event_sync_required)
    except RuntimeError as exc:
        raise BadRequest(f"cannot open the CUDA IPC handle of a tensor on GPU "
                         f"{spec.gpu_uuid}: {exc}") from None


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
