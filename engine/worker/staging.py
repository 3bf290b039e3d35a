"""A step's small integer arrays to the device in one copy.

Each step needs a handful of index arrays on the device (input ids, positions, logits rows, KV
slots, page indices). Copied one by one from pageable numpy memory, each is a blocking
host-to-device transfer. ``HostStaging`` packs them into one host buffer (pinned on CUDA), each
array at an 8-byte-aligned offset in its own dtype, and copies the used bytes once,
non-blocking; the device tensors it returns are views of one device buffer.

Reuse: two buffer pairs alternate. Before a host buffer is written again, the event recorded
after its last copy is waited on, so a copy still in flight is never overwritten; a device
buffer is rewritten only by a copy queued on the same stream after the step that read it.
On CPU nothing is copied: the returned tensors are views of the packed host buffer.

``to_device`` is the one-array form, for arrays outside a step's pack (sampling parameters,
swap page lists).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 8


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._device: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """``arrays`` (1-D numpy, any integer or float dtype) as device tensors of the same
        dtypes and contents."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        turn, self._turn = self._turn, self._turn ^ 1
        host = self._host_buffer(turn, total)
        packed = host.numpy()
        for a, start in zip(arrays, offsets, strict=True):
            packed[start : start + a.nbytes] = a.view(np.uint8)
        if self._cuda:
            target = self._device[turn][:total]
            target.copy_(host[:total], non_blocking=True)
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        else:
            target = host
        return [target[start : start + a.nbytes].view(_torch_dtype(a.dtype))
                for a, start in zip(arrays, offsets, strict=True)]

    def _host_buffer(self, turn: int, size: int) -> torch.Tensor:
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # its last copy has read the bytes
        host = self._host[turn]
        if host is None or host.numel() < size:
            size = max(size + size // 2, 4096)
            host = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
            self._host[turn] = host
            if self._cuda:
                self._device[turn] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return host


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the device.

    A copy from pageable memory makes the host wait for all work queued before it; from pinned
    memory it is queued like a kernel. The pinned buffer comes from torch's caching host
    allocator, which does not reuse it until the copy has run. The array is made contiguous
    first: a strided source would go through a pageable temporary. On CPU, no copy.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
