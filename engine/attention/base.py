"""The interface every attention backend implements.

One step: ``plan(batch)`` once (build page tables / masks / kernel plans from the batch's arrays),
then ``forward(layer, q, k, v)`` for each layer in order. ``forward`` first stores the new
tokens' K and V in the pool at ``batch.out_slots``, then attends each new token over its
sequence's pages (cached prefix + new tokens) with a causal mask at absolute positions, and a
sliding window on the layers that have one.

Shapes: q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim], output like q; T is
the batch's new tokens in batch order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from engine.batch import BatchInput
from engine.kv_pool import KVPool


class AttentionBackend(ABC):
    name: str

    def __init__(
        self,
        pool: KVPool,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: Sequence[int | None],
    ) -> None:
        self.pool = pool
        self.device = pool.device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.sliding_windows = tuple(sliding_windows)
        self._out_slots: torch.Tensor | None = None

    def plan(self, batch: BatchInput) -> None:
        self._out_slots = torch.from_numpy(batch.out_slots.astype("int64")).to(
            self.device, non_blocking=True
        )
        self._plan(batch)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self._out_slots, k, v)
        return self._attend(layer, q)

    @abstractmethod
    def _plan(self, batch: BatchInput) -> None:
        """Prepare whatever every layer of this step reuses."""

    @abstractmethod
    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q over the pool (which already holds this step's K and V)."""
