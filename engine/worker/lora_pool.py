"""The worker's LoRA adapters: host copies of every loaded one, ``max_loras`` resident on the
device, and each step's low-rank updates.

Memory: per layer and fused projection, one device tensor of A slots
[max_loras, parts * max_rank, in] and one of B slots held transposed,
[max_loras, parts * max_rank, out], allocated at start. An adapter in slot ``s`` fills the
first ``parts * rank`` rows of both (``widths``: how many, per layer, projection and slot); a
step uses exactly those (no padded rank is multiplied). Which adapter holds which slot changes
only in ``prepare``, before a step's forward, least recently used first and never one the step
itself uses: an adapter is never swapped mid-step. The scheduler puts at most ``max_loras``
adapters in one step (more wait for a later one). Under tensor parallel every rank has its own
pool of its share of each adapter (engine/worker/model/lora.py), shaped as its share of the
base weights: ``in`` and ``out`` above are this rank's.

A step (``LoraStep``): per layer and projection, each token's row of the base projection's
output gains ``B_s (A_s x)`` of its adapter's slot ``s`` (the base model's rows, none, and they
pay nothing), whatever format the base weight is in. On CPU with the compiled kernels that is
one op (``torch.ops.radixserve.lora_bgmv``, csrc/lora_bgmv.cpp, Punica's BGMV form: rows of one
adapter share each read of its weights, products in float32; ``spans`` tell it the columns of
each row of B^T that are not zeros, so that it skips the fused parts a rank row does not
reach: two thirds of q/k/v's B, half of gate/up's), and the slots hold bf16 for a
bf16 model (widened in registers: half the bytes of float32, which the op's decode steps are
bound by), float32 otherwise. Without the kernels (CUDA, ``RADIXSERVE_CPU_KERNELS=0``, no
compiler) the update is S-LoRA's segmented form in torch: the adapted rows are gathered once in
adapter order, each adapter's segment takes one pair of small matmuls, and one scatter adds
every delta (none when the adapted rows are all the step's, in order); on CPU the slots are then
float32 whatever the model's dtype, since CPU torch's small bf16 products are 3-4x slower than
float32's (docs/benchmarks.md, "Multi-LoRA serving").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from engine.contracts.lora import BASE_MODEL, LoraAdapterInfo
from engine.worker.cpu_kernels import lora_bgmv_op
from engine.worker.model.config import ModelConfig
from engine.worker.model.lora import LoraWeights, projection_shapes
from engine.worker.model.parallel import ShardPlan


class LoraPool:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, plan: ShardPlan | None = None
                 ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device = device
        self.kernel = lora_bgmv_op() if device.type == "cpu" else None
        if self.kernel is not None:  # bf16: half the bytes that a many-adapter step reads
            self.dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        else:
            self.dtype = torch.float32 if device.type == "cpu" else dtype
        shapes = projection_shapes(config, plan)  # this rank's, under tensor parallel
        self.names = list(shapes)
        self.slots_a: list[dict[str, torch.Tensor]] = []
        self.slots_b: list[dict[str, torch.Tensor]] = []  # B transposed: [slot, rank, out]
        for _ in range(config.num_layers):
            self.slots_a.append({name: torch.zeros(max_loras, len(outs) * max_rank, width,
                                                   device=device, dtype=self.dtype)
                                 for name, (width, outs) in shapes.items()})
            self.slots_b.append({name: torch.zeros(max_loras, len(outs) * max_rank, sum(outs),
                                                   device=device, dtype=self.dtype)
                                 for name, (width, outs) in shapes.items()})
        # [layer, projection (as in names), slot] -> rows of A and B in use; 0: not adapted
        self.widths = np.zeros((config.num_layers, len(shapes), max_loras), dtype=np.int64)
        views = torch.from_numpy(self.widths)  # shares the array's memory: _fill updates both
        self.width_tensors = {(layer, name): views[layer, k]
                              for layer in range(config.num_layers)
                              for k, name in enumerate(self.names)}
        # (layer, projection) -> [slot, row of B^T, (begin, end)]: its nonzero columns, which
        # the kernel reads (the others hold zeros: the fused parts the row does not reach)
        self.spans = {(layer, name): torch.zeros(max_loras, len(outs) * max_rank, 2,
                                                 dtype=torch.int64)
                      for layer in range(config.num_layers)
                      for name, (_, outs) in shapes.items()}
        self.adapters: dict[int, LoraWeights] = {}  # lora id -> host copy
        self.host_spans: dict[int, dict[tuple[int, str], torch.Tensor]] = {}  # lora id -> spans
        self.infos: dict[int, LoraAdapterInfo] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.swaps = 0
        self.swap_seconds = 0.0

    def add(self, lora_id: int, weights: LoraWeights, path: str = "") -> LoraAdapterInfo:
        """Keep ``weights`` as adapter ``lora_id`` (on the host until a step needs it)."""
        self.remove(lora_id)
        self.adapters[lora_id] = weights
        self.host_spans[lora_id] = {key: _nonzero_spans(bt) for key, (_, bt) in weights.mats.items()}
        self.infos[lora_id] = LoraAdapterInfo(weights.name, lora_id, weights.rank,
                                              weights.content_hash, path)
        return self.infos[lora_id]

    def remove(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        self.host_spans.pop(lora_id, None)
        self.infos.pop(lora_id, None)
        self.resident.pop(lora_id, None)

    def check(self, lora_ids: np.ndarray) -> None:
        """ValueError for a step naming an adapter this pool lacks or more than it holds."""
        wanted = set(np.unique(lora_ids).tolist()) - {BASE_MODEL}
        unknown = wanted - set(self.adapters)
        if unknown:
            raise ValueError(f"the step names LoRA adapter ids {sorted(unknown)} that the "
                             "worker has not loaded")
        if len(wanted) > self.max_loras:
            raise ValueError(f"the step uses {len(wanted)} LoRA adapters but --max-loras is "
                             f"{self.max_loras}")

    def prepare(self, lora_ids: np.ndarray, extend_lens: np.ndarray) -> LoraStep | None:
        """Make the step's adapters resident and group its tokens by adapter; None when every
        sequence runs the base model. ``lora_ids``: per sequence (empty: all base)."""
        if not len(lora_ids) or not np.any(lora_ids != BASE_MODEL):
            return None
        wanted = [int(i) for i in np.unique(lora_ids) if i != BASE_MODEL]
        slot_of = np.full(int(max(wanted)) + 1, -1, dtype=np.int64)
        for lora_id in wanted:
            slot_of[lora_id] = self._resident_slot(lora_id, keep=set(wanted))
        token_slots = np.repeat(slot_of[np.asarray(lora_ids, dtype=np.int64)], extend_lens)
        return LoraStep(self, token_slots)

    def _resident_slot(self, lora_id: int, keep: set[int]) -> int:
        if lora_id in self.resident:
            self.resident.move_to_end(lora_id)
            return self.resident[lora_id]
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.resident if i not in keep)
            slot = self.resident.pop(victim)
        started = time.perf_counter()
        self._fill(slot, self.adapters[lora_id], self.host_spans[lora_id])
        self.swap_seconds += time.perf_counter() - started
        self.swaps += 1
        self.resident[lora_id] = slot
        return slot

    def _fill(self, slot: int, weights: LoraWeights,
              spans: dict[tuple[int, str], torch.Tensor]) -> None:
        self.widths[:, :, slot] = 0
        for (layer, name), (a, bt) in weights.mats.items():
            width = a.shape[0]
            self.slots_a[layer][name][slot, :width].copy_(a, non_blocking=True)
            self.slots_b[layer][name][slot, :width].copy_(bt, non_blocking=True)
            self.spans[(layer, name)][slot, :width] = spans[(layer, name)]
            self.widths[layer, self.names.index(name), slot] = width

    def matrices(self, slot: int, layer: int, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Slot ``slot``'s A [R, in] and transposed B [R, out] for one projection, None if not
        adapted."""
        width = int(self.widths[layer, self.names.index(name), slot])
        if not width:
            return None
        return self.slots_a[layer][name][slot, :width], self.slots_b[layer][name][slot, :width]


class LoraStep:
    """One step's tokens grouped by adapter slot, and the update each projection adds."""

    def __init__(self, pool: LoraPool, token_slots: np.ndarray) -> None:
        self.pool, self.token_slots = pool, token_slots
        self._plans: dict[tuple[int, int], _Plan] = {}

    def plan(self, start: int, count: int) -> _Plan:
        """How tokens [start, start + count) are updated (rows relative to ``start``). Cached:
        every layer and projection asks for the same ranges."""
        key = (start, count)
        found = self._plans.get(key)
        if found is None:
            slots = self.token_slots[start : start + count]
            rows = np.flatnonzero(slots >= 0)
            rows = rows[np.argsort(slots[rows], kind="stable")]
            ordered = slots[rows]
            cuts = np.flatnonzero(np.diff(ordered)) + 1
            bounds = np.concatenate(([0], cuts, [len(rows)])).tolist()
            segments = [(int(ordered[lo]), lo, hi) for lo, hi in zip(bounds, bounds[1:],
                                                                    strict=False) if hi > lo]
            everything = len(rows) == count and bool(np.all(rows == np.arange(count)))
            index = None if everything else torch.from_numpy(rows).to(self.pool.device)
            found = self._plans[key] = _Plan(index, segments, len(rows), torch.from_numpy(slots))
        return found

    def add_(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor,
             start: int = 0) -> None:
        """out += each adapter's update of projection ``name`` of ``layer`` for its rows of
        ``x`` (tokens [start, start + len(x)) of the step; ``out`` row-aligned with ``x``)."""
        plan, pool = self.plan(start, x.shape[0]), self.pool
        if not plan.num_rows:
            return
        if pool.kernel is not None:
            pool.kernel(x.to(out.dtype), pool.slots_a[layer][name], pool.slots_b[layer][name],
                        plan.slots, pool.width_tensors[(layer, name)], pool.spans[(layer, name)],
                        out)
            return
        mats = [pool.matrices(slot, layer, name) for slot, _, _ in plan.segments]
        if all(m is None for m in mats):
            return
        rows = x if plan.index is None else x.index_select(0, plan.index)
        rows = rows.to(pool.dtype)
        delta = rows.new_zeros(plan.num_rows, out.shape[1])
        for (_, lo, hi), pair in zip(plan.segments, mats, strict=True):
            if pair is not None:
                a, b = pair
                torch.mm(rows[lo:hi] @ a.t(), b, out=delta[lo:hi])
        if plan.index is None:
            out += delta.to(out.dtype)
        else:
            out.index_add_(0, plan.index, delta.to(out.dtype))


def _nonzero_spans(bt: torch.Tensor) -> torch.Tensor:
    """[rows, 2]: each row's first nonzero column and one past its last; (0, 0) if none."""
    nonzero = (bt != 0).to(torch.int8)
    begin = nonzero.argmax(1)
    end = bt.shape[1] - nonzero.flip(1).argmax(1)
    return torch.where(nonzero.any(1)[:, None], torch.stack((begin, end), 1), 0)


class _Plan(NamedTuple):
    index: torch.Tensor | None  # the adapted rows in adapter order; None: all rows, in order
    segments: list[tuple[int, int, int]]  # (slot, first, end) in that order
    num_rows: int
    slots: torch.Tensor  # int64, each row's slot (-1: the base model), on the host
