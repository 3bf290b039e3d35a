"""A step's small integer arrays to the device in one copy.

Each step needs a handful of index arrays on the device (input ids, positions, logits rows, KV
slots, page indices) and a few on the host for FlashInfer's planner (page-table offsets, last
page lengths). Copied one by one from pageable numpy memory, each is a blocking host-to-device
transfer: the host waits for everything queued before it. ``HostStaging`` packs them into one
host buffer (pinned on CUDA), each array at an 8-byte-aligned offset in its own dtype, and
copies the used bytes once, non-blocking. Each array comes back as a ``Staged`` pair: its view
in one device buffer (for kernels) and its view in the pinned host buffer (for host-side
planners, whose own copies from pinned memory are queued like kernels, never waited for).

Reuse: two buffer pairs alternate. A pack's pinned bytes are released by an event recorded when
the *next* pack is staged, so it also covers copies that readers of the pinned views queued
during their step (FlashInfer's ``plan``); a host buffer is written again only once that event
has passed. A device buffer is rewritten only by a copy queued on the same stream after the step
that read it. On CPU nothing is copied: both views are the packed host buffer.

``to_device_many`` is the same single copy for arrays outside a step's pack (copy-on-write
slots, cascade plans), from a pinned block of torch's caching host allocator; ``to_device`` is
its one-array form (sampling parameters, swap page lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 8


@dataclass(frozen=True)
class Staged:
    """One staged array: ``on_device`` for kernels, ``pinned`` (the same bytes, in the pinned
    host buffer) for host-side planners; both valid until the pack after next is staged."""

    on_device: torch.Tensor
    pinned: torch.Tensor


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._device: list[torch.Tensor | None] = [None, None]
        self._released: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._last: int | None = None

    def stage(self, arrays: Sequence[np.ndarray]) -> list[Staged]:
        """``arrays`` (1-D numpy, any integer or float dtype) as ``Staged`` tensors of the same
        dtypes and contents."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = _layout(arrays)
        if self._cuda and self._last is not None:
            # Every reader of the last pack's pinned bytes has queued its copy by now.
            self._released[self._last] = torch.cuda.Event()
            self._released[self._last].record()
        turn, self._turn = self._turn, self._turn ^ 1
        self._last = turn
        host = self._host_buffer(turn, total)
        _pack(arrays, offsets, host)
        if self._cuda:
            target = self._device[turn][:total]
            target.copy_(host[:total], non_blocking=True)
        else:
            target = host
        return [Staged(view, pinned) for view, pinned in zip(_views(target, arrays, offsets),
                                                             _views(host, arrays, offsets),
                                                             strict=True)]

    def _host_buffer(self, turn: int, size: int) -> torch.Tensor:
        if self._released[turn] is not None:
            self._released[turn].synchronize()  # every copy of its last pack has read it
        host = self._host[turn]
        if host is None or host.numel() < size:
            size = max(size + size // 2, 4096)
            host = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
            self._host[turn] = host
            if self._cuda:
                self._device[turn] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return host


def to_device_many(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Small host arrays on ``device`` in one non-blocking copy, without waiting for the device.

    A copy from pageable memory makes the host wait for all work queued before it; from pinned
    memory it is queued like a kernel. The arrays are packed into one pinned block from torch's
    caching host allocator, which does not reuse it until the copy has run. On CPU, no copy:
    the arrays' own memory."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = _layout(arrays)
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    _pack(arrays, offsets, host)
    return _views(host.to(device, non_blocking=True), arrays, offsets)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One small host array on ``device`` without waiting for the device (``to_device_many``)."""
    return to_device_many([array], device)[0]


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Each array's byte offset in a pack, and the pack's size."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, total


def _pack(arrays: Sequence[np.ndarray], offsets: Sequence[int], host: torch.Tensor) -> None:
    packed = host.numpy()
    for a, start in zip(arrays, offsets, strict=True):
        packed[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)


def _views(buffer: torch.Tensor, arrays: Sequence[np.ndarray],
           offsets: Sequence[int]) -> list[torch.Tensor]:
    return [buffer[start : start + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
            for a, start in zip(arrays, offsets, strict=True)]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
