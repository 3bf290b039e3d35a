"""The interface every attention backend implements.

One step: ``plan(batch)`` once (build page tables / masks / kernel plans from the batch's arrays),
then ``forward(layer, q, k, v)`` for each layer in order. ``plan(batch, graph=True)`` prepares
a step that replays a captured CUDA graph (engine/worker/cuda_graphs.py): a backend that supports
capture (``supports_cuda_graph``) then plans kernels over fixed buffers the graph reads. ``forward`` first stores the new
tokens' K and V in the pool at ``batch.out_slots``, then attends each new token over its
sequence's pages (cached prefix + new tokens) with a causal mask at absolute positions, and a
sliding window on the layers that have one.

A pool whose sliding-window layers have pages of their own (engine/worker/kv_pool.py) gets a
second plan, over the step's ``sliding_view``; each layer runs on its kind's plan
(``_step_state`` names what a plan sets).

Shapes: q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim], output like q; T is
the batch's new tokens in batch order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from engine.contracts.step import BatchInput
from engine.worker.kv_pool import KVPool
from engine.worker.staging import HostStaging, Staged


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's sign folded into ``signed_sin`` (as
    engine/worker/model/llama.py's RotaryEmbedding gives it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(signed_sin)
    return rotated.addcmul_(x, cos)


class AttentionBackend(ABC):
    name: str
    supports_cuda_graph = False
    _step_state: tuple[str, ...] = ("_out_slots",)  # what ``plan`` sets for the step
    def __init__(self, pool: KVPool, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_windows: Sequence[int | None], scale: float | None = None) -> None:
        self.pool = pool
        self.device = pool.device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # the scores' factor: 1 / sqrt(head_dim) unless the model says otherwise (Gemma 3's
        # query_pre_attn_scalar)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_windows = tuple(sliding_windows)
        self._out_slots: torch.Tensor | None = None
        self._staging = HostStaging(self.device)  # for plans the runner has not staged
        self._sliding_staging = HostStaging(self.device)
        # with sliding pages: each layer kind's plan (full, sliding) and the one set now
        self._kind_plans: tuple[dict, dict] | None = None
        self._kind = False
        # set while staging and planning the sliding layers' step
        self._plan_window: int | None = None

    def plan(self, batch: BatchInput, out_slots: torch.Tensor | None = None, *,
             staged: Sequence[Staged] = (), graph: bool = False,
             swa_out_slots: torch.Tensor | None = None) -> None:
        """Prepare the step. The runner stages the step's arrays in one copy
        (engine/worker/staging.py): ``out_slots`` is ``batch.out_slots`` on the device as int64
        and ``staged`` holds ``staged_arrays(batch)``; given no ``out_slots``, the backend
        stages both itself, the same way. ``swa_out_slots``: ``batch.swa_out_slots`` already
        on the device (a CUDA graph's fixed buffer), else staged here with the sliding plan's
        arrays."""
        if out_slots is None:
            slots, *staged = self._staging.stage([batch.out_slots.astype(np.int64),
                                                  *self.staged_arrays(batch)])
            out_slots = slots.on_device
        self._out_slots = out_slots
        self._plan(batch, graph, staged)
        self._kind_plans = None
        if batch.has_sliding_pages:
            full = {name: getattr(self, name) for name in self._step_state}
            view = batch.sliding_view()
            self._plan_window = next(w for w, sliding in zip(
                self.sliding_windows, self.pool.sliding_layers, strict=True) if sliding)
            try:
                slots, *staged = self._sliding_staging.stage([view.out_slots.astype(np.int64),
                                                              *self.staged_arrays(view)])
                self._out_slots = slots.on_device if swa_out_slots is None else swa_out_slots
                self._plan(view, graph, staged)
            finally:
                self._plan_window = None
            self._kind_plans = (full, {name: getattr(self, name) for name in self._step_state})
            self._kind = True

    def _use_kind(self, layer: int) -> None:
        """Set ``layer``'s kind's plan (the sliding layers' or the others')."""
        if self._kind_plans is not None:
            sliding = self.pool.sliding_layers[layer]
            if sliding != self._kind:
                for name, value in self._kind_plans[sliding].items():
                    setattr(self, name, value)
                self._kind = sliding

    def staged_arrays(self, batch: BatchInput) -> list[np.ndarray]:
        """Arrays of ``batch`` this backend's plan wants staged: on the device, and pinned on
        the host for host-side planning."""
        return []

    def prepare_graphs(self, max_batch: int) -> None:  # noqa: B027 (optional hook)
        """Make whatever fixed buffers graph steps of up to ``max_batch`` sequences need
        (none here)."""

    def graph_fits(self, batch: BatchInput) -> bool:
        """Whether this decode step, padded to any bucket, fits the graphs' fixed buffers
        (FlashInfer's page-index buffer bounds the pages a step may list)."""
        return True

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> torch.Tensor:
        self._use_kind(layer)
        self.pool.write(layer, self._out_slots, k, v)
        return self._attend(layer, q)

    def forward_rotating(self, layer: int, qk: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """``forward`` for q and k not yet rotated: ``qk`` [T, num_heads + num_kv_heads,
        head_dim], rotated by ``apply_rope`` (together: one set of elementwise ops instead of
        two); a backend may fuse the rotation with the store of K and V."""
        q, k = apply_rope(qk, cos, signed_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        return self.forward(layer, q, k, v)

    @abstractmethod
    def _plan(self, batch: BatchInput, graph: bool, staged: Sequence[Staged]) -> None:
        """Prepare whatever every layer of this step reuses (``graph``: over the fixed
        buffers of a captured graph; ``staged``: ``staged_arrays(batch)``, staged)."""

    @abstractmethod
    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q over the pool (which already holds this step's K and V)."""
