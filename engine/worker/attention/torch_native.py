"""Attention over paged KV with plain torch (any device): gather pages, mask, one SDPA call.

A step's sequences split into groups, each served by one call per layer:

- decode group (sequences adding one token; with the compiled kernel also those adding up to
  ``PAGED_MAX_EXTEND``: a verify step's last token and drafts, causal among themselves): on a
  CPU with AVX-512 or AVX2 (with FMA and F16C), and for int8 pages on any CPU, the compiled
  kernel (engine/worker/cpu_kernels.py) reads every sequence's keys straight from its pages
  (faster than gather + SDPA at batch 8: 2-2.5x at 608-token contexts with AVX-512, 3.2x at
  4,096 with the AVX2 loops); when members of groups share enough pages
  (``CASCADE_MIN_SAVED_KEYS``), the cascade attends those once and the kernel the rest (a
  group with several rows a sequence then takes the extend path's cascade).
  Elsewhere, or without the kernel, q is laid out [B, kv_heads, group, head_dim] so the query
  heads sharing a KV head attend together without repeating K/V, and the mask [B, 1, 1, S]
  broadcasts over them;
- extend group (the rest): in bf16 on a CPU whose torch offers a bf16 brgemm (AMX, AVX-512
  BF16), the compiled extend kernel (csrc/extend_attention.cpp) reads every sequence's keys
  straight from its pages, several query rows a sequence, as the decode kernel does, with no
  gather, padding or mask tensor, for extends of up to ``EXTEND_KERNEL_MAX_ROWS`` rows (where
  it measured faster than gather + SDPA). Elsewhere queries padded to [B, max_extend], K/V
  gathered to [B, max_pages * page_size] and an additive mask [B, 1, max_extend, S] (causal
  at absolute positions, sliding window where the layer has one); when no sequence of the
  group has cached tokens, SDPA's built-in causal mask instead.

Deterministic steps (``--deterministic``) are one group: every sequence's new rows, prefill
and extend rows as well as decodes, through the compiled kernel, without the cascade. The kernel
sums each row's keys in blocks of 16 aligned to position 0 (csrc/paged_decode.cpp), so a row's
output is the same bits whatever the step around it: a prefill row equals the decode of that
token, a chunk boundary or a cached prefix changes nothing, nor does the page size. Slower
than SDPA for long prefills (docs/benchmarks.md).

Gathering whole pages keeps indices few; the mask hides the unused tail of the last page.
Padded query rows get the position of their sequence's last token so no row is fully masked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.contracts.step import BatchInput
from engine.worker.attention.base import AttentionBackend
from engine.worker.attention.cascade import CascadePlan, attend_cascade, plan_cascade
from engine.worker.cpu_kernels import extend_attention_op, paged_decode_op, rope_store_op
from engine.worker.kv_quant import FP8_DTYPES, decode
from engine.worker.staging import to_device_many


@dataclass
class _Group:
    rows: torch.Tensor | None  # token rows of [T] in this group; None: all rows, in order
    pad_index: torch.Tensor | None  # row of [B * max_extend] for each token; None: no padding
    page_table: torch.Tensor  # int64 [B * max_pages] flattened page ids
    num_seqs: int
    max_extend: int
    kv_len: int  # max_pages * page_size
    masks: dict[int | None, torch.Tensor]  # by sliding window; absent: plain causal
    cascade: CascadePlan | None  # shared leading pages: attended once per group (cascade.py)
    # The compiled decode kernel's int32 page table (indptr, indices) and seq_lens; None: SDPA.
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The compiled op that attends ``paged``: the extend kernel's; None: the decode kernel's.
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


# A decode step on the compiled kernel takes the cascade for its shared pages only when that
# saves reading at least this many keys (summed over members past each group's first); below
# it the cascade's extra ops cost more than the kernel's repeated reads. Crossover measured at
# ~7,000 for the demo model and SmolLM2 alike (8 members sharing 1,024 tokens: equal; 16
# members: cascade 4.1 vs 5.3 ms per demo step, 43.3 vs 49.1 ms SmolLM2; 8 sharing 512: kernel
# 2.9 vs 3.2 ms, 30.1 vs 31.9 ms).
CASCADE_MIN_SAVED_KEYS = 8192

# Sequences adding at most this many tokens in a step attend through the compiled kernel, as
# decodes do (one call for all of them, several query rows a sequence, causal among its new
# tokens): a verify of up to 16 draft tokens (``num_speculative_tokens``' bound) and its last
# token, and short extends. Longer extends pad into SDPA groups, whose flash kernel skips the
# masked blocks of a long causal extend.
PAGED_MAX_EXTEND = 17

# Longer extends of up to this many rows attend through the compiled extend kernel (bf16), all
# in one call: faster than gather + SDPA at every shape measured up to 1,536 rows (0.41-0.91x; a
# question over a cached head, ~0.5x); 0.90x at 1,792 rows from position 0 and 0.92-1.05x at
# 2,048, where SDPA's flash kernel serves (docs/benchmarks.md's "Prefill on AMX").
EXTEND_KERNEL_MAX_ROWS = 1536


def _padded_pages(batch: BatchInput, seqs: np.ndarray,
                  first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``seqs``' pages sits in ``batch.page_indices``, [B, max_pages], each row
    padded by repeating its last page (real memory, which masks or counts hide); and the
    page counts [B]. ``first``: each sequence's first page to take (those before it skipped)."""
    start = batch.page_indptr[seqs].astype(np.int64)
    counts = batch.page_indptr[seqs + 1] - start
    if first is not None:
        start, counts = start + first, counts - first
    take = start[:, None] + np.minimum(np.arange(int(counts.max())), counts[:, None] - 1)
    return take, counts


class TorchNativeBackend(AttentionBackend):
    name = "torch"
    _step_state = ("_out_slots", "_groups")

    def __init__(self, *args, compiled: bool = True, deterministic: bool = False,
                 **kwargs) -> None:
        """``compiled``: decode through the compiled CPU kernel where it is available.
        ``deterministic``: every row of every step through that kernel, in one group and
        without the cascade, so a row's result never depends on the step it is in (below)."""
        super().__init__(*args, **kwargs)
        self._gather_buffers: list[torch.Tensor | None] = [None, None]  # K, V
        self._qk_heads = [self.num_heads, self.num_kv_heads]
        # The compiled ops read and write pages in the model's dtype or int8 rows; an fp8
        # pool's steps take the torch paths, which decode the pages a step gathers.
        on_cpu = compiled and self.device.type == "cpu" and self.pool.kv_dtype not in FP8_DTYPES
        # Deterministic steps take the kernel in every build (its plain C++ loops too): only
        # the kernel fixes each row's order of sums.
        self._paged_decode = (paged_decode_op(self.pool.quantized or deterministic)
                              if on_cpu else None)
        self._rope_store = rope_store_op() if on_cpu else None
        self.deterministic = deterministic and self._paged_decode is not None
        # Longer extends of bf16 pages: the extend kernel, except under --deterministic, whose
        # rows keep the decode kernel's order of sums.
        bf16_pages = self.pool.kv_dtype == torch.bfloat16
        self._extend_attention = (
            extend_attention_op() if on_cpu and bf16_pages and not deterministic
            and self.head_dim % 32 == 0 and self.head_dim <= 256 else None)

    def forward_rotating(self, layer: int, qk: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """On CPU: rotate q and k and store k and v at the step's slots in one compiled op,
        then attend."""
        if self._rope_store is None:
            return super().forward_rotating(layer, qk, v, cos, signed_sin)
        self._use_kind(layer)
        q, k = qk.split_with_sizes(self._qk_heads, 1)  # not Tensor.split: a Python frame
        k_slots, v_slots = self.pool.slots(layer)
        q = self._rope_store(q, k, v, cos, signed_sin, self._out_slots, k_slots, v_slots)
        return self._attend(layer, q)

    def _plan(self, batch: BatchInput, graph: bool = False, staged=()) -> None:
        # No fixed buffers (``supports_cuda_graph`` is False): a graph step plans like any
        # other, which is what DecodeGraphs(capture=False) runs on CPU.
        # With the compiled kernel, decodes and short extends (a verify of draft tokens: its
        # last token and the drafts) attend in one kernel call; without it, decodes alone.
        if self.deterministic:
            self._groups = [self._plan_paged(batch, np.arange(batch.num_seqs), True)]
            return
        short = PAGED_MAX_EXTEND if self._paged_decode is not None else 1
        paged = batch.extend_lens <= short
        groups = [np.nonzero(paged)[0]]
        # Extends pad to their group's longest: bucket them by length within a factor of 2, so
        # a 65-token extend never pads to a 2,000-token prefill's rows. The extend kernel pads
        # nothing: all of them in one call.
        extends = np.nonzero(~paged)[0]
        if self._extend_attention is not None:
            kernel = batch.extend_lens[extends] <= EXTEND_KERNEL_MAX_ROWS
            groups.append(extends[kernel])
            extends = extends[~kernel]
        extends = extends[np.argsort(batch.extend_lens[extends], kind="stable")]
        start = 0
        for i in range(1, len(extends) + 1):
            if i == len(extends) or (batch.extend_lens[extends[i]]
                                     > 2 * batch.extend_lens[extends[start]]):
                groups.append(np.sort(extends[start:i]))
                start = i
        groups = [g for g in groups if len(g)]
        whole = len(groups) == 1
        self._groups = [self._plan_group(batch, seqs, whole) for seqs in groups]

    def _plan_group(self, batch: BatchInput, seqs: np.ndarray, whole: bool) -> _Group:
        page_size, device = self.pool.page_size, self.device
        extend = batch.extend_lens[seqs].astype(np.int64)
        num_seqs, max_extend = len(seqs), int(extend.max())
        if max_extend <= PAGED_MAX_EXTEND and self._paged_decode is not None:
            paged = self._plan_paged(batch, seqs, whole)
            if paged is not None:
                return paged
        if (self._extend_attention is not None
                and PAGED_MAX_EXTEND < max_extend <= EXTEND_KERNEL_MAX_ROWS):
            return self._plan_paged(batch, seqs, whole, extend_kernel=True)
        num_tokens = int(extend.sum())
        seq_of_token = np.repeat(np.arange(num_seqs), extend)
        offset = np.arange(num_tokens) - np.repeat(np.cumsum(extend) - extend, extend)
        first_row = (np.cumsum(batch.extend_lens) - batch.extend_lens)[seqs]
        rows = first_row[seq_of_token] + offset

        # The sliding layers' own plan gathers no page before any query's window.
        first = (None if self._plan_window is None else np.maximum(
            batch.seq_lens[seqs] - extend + 1 - self._plan_window, 0) // page_size)
        take, num_pages = _padded_pages(batch, seqs, first)
        max_pages = take.shape[1]
        page_table = batch.page_indices[take].reshape(-1).astype(np.int64)
        kv_len = max_pages * page_size

        pad_index = seq_of_token * max_extend + offset
        query_pos = np.repeat(batch.seq_lens[seqs].astype(np.int64) - 1, max_extend)
        query_pos[pad_index] = batch.positions[rows]
        if first is not None:  # positions from each sequence's first gathered page
            query_pos -= np.repeat(first * page_size, max_extend)
        from_zero = max_extend > 1 and bool(np.all(batch.seq_lens[seqs] == extend))
        cascade = None
        # A cached prefix shared by a group is gathered and attended once (cascade.py); not
        # with sliding windows, where "every query sees all of the shared part" fails.
        if not from_zero and all(w is None for w in self.sliding_windows):
            cascade = plan_cascade(batch.page_indices[take], num_pages.astype(np.int64),
                                   batch.seq_lens[seqs].astype(np.int64),
                                   query_pos.reshape(num_seqs, max_extend), page_size, device,
                                   self.pool.dtype)
        # The group's arrays reach the device in one non-blocking copy (no sync).
        arrays = {"page_table": page_table}
        if not whole:
            arrays["rows"] = rows
        if num_seqs * max_extend != num_tokens:
            arrays["pad_index"] = pad_index
        if cascade is None:
            arrays["query_pos"] = query_pos
        staged = dict(zip(arrays, to_device_many(list(arrays.values()), device), strict=True))
        masks = {} if cascade is not None else self._masks(
            staged["query_pos"].view(num_seqs, max_extend, 1), kv_len, max_extend, from_zero)
        return _Group(rows=staged.get("rows"), pad_index=staged.get("pad_index"),
                      page_table=staged["page_table"], num_seqs=num_seqs, max_extend=max_extend,
                      kv_len=kv_len, masks=masks, cascade=cascade)

    def _plan_paged(self, batch: BatchInput, seqs: np.ndarray, whole: bool,
                    extend_kernel: bool = False) -> _Group | None:
        """A group for the compiled kernel: its sequences' page lists as int32 CSR and, when
        some sequence adds several tokens (a verify), each one's query rows (``q_indptr``).
        None: a verify group whose shared pages the cascade should attend once (the extend
        path's plan does). ``extend_kernel``: for the extend kernel, which takes no cascade."""
        extend = batch.extend_lens[seqs].astype(np.int64)
        if whole:
            indptr, indices, seq_lens = batch.page_indptr, batch.page_indices, batch.seq_lens
        else:
            starts = batch.page_indptr[seqs].astype(np.int64)
            counts = batch.page_indptr[seqs + 1] - starts
            indptr = np.concatenate(([0], np.cumsum(counts)))
            take = np.repeat(starts - indptr[:-1], counts) + np.arange(indptr[-1])
            indices, seq_lens = batch.page_indices[take], batch.seq_lens[seqs]
        arrays = [indptr, indices, seq_lens]
        multi = bool(np.any(extend > 1))
        if multi:
            arrays.append(np.concatenate(([0], np.cumsum(extend))))
        # Copies (a few KB): the batch's arrays may be read-only views of the message.
        paged = tuple(torch.from_numpy(np.array(a, dtype=np.int32)) for a in arrays)
        # The group's rows of the step's [T] tokens: each sequence's new tokens, in order.
        last = np.cumsum(batch.extend_lens, dtype=np.int64)[seqs]
        rows = (np.repeat(last - extend, extend)
                + np.arange(int(extend.sum())) - np.repeat(np.cumsum(extend) - extend, extend))
        cascade = None
        # Deterministic plans take no cascade: its merge would sum a shared prefix's part in
        # another order than the row's own decode. Nor do the extend kernel's, which attends a
        # wave of questions over one shared head faster per sequence than the cascade's SDPA
        # attends the head once (docs/benchmarks.md's "Prefill on AMX").
        if multi and not (self.deterministic or extend_kernel):
            # The kernel's cascade attends one query row a sequence: a verify group whose
            # shared prefix would pay for it takes the extend path's cascade instead.
            if self._paged_cascade(batch, seqs, paged[:3]) is not None:
                return None
        elif not (self.deterministic or extend_kernel):
            cascade = self._paged_cascade(batch, seqs, paged)
        return _Group(rows=None if whole else torch.from_numpy(rows),
                      pad_index=None, page_table=paged[1], num_seqs=len(seqs),
                      max_extend=int(extend.max()), kv_len=0, masks={}, cascade=cascade,
                      paged=paged, kernel=self._extend_attention if extend_kernel else None)

    def _paged_cascade(self, batch: BatchInput, seqs: np.ndarray,
                       paged: tuple[torch.Tensor, ...]) -> CascadePlan | None:
        """For a decode group on the compiled kernel: a cascade when its groups share enough
        that attending their shared pages once (SDPA over all members' queries together) beats
        the kernel reading them once per member; the kernel attends each own part."""
        if any(w is not None for w in self.sliding_windows):
            return None
        take, counts = _padded_pages(batch, seqs)
        seq_lens = batch.seq_lens[seqs].astype(np.int64)
        plan = plan_cascade(batch.page_indices[take], counts.astype(np.int64), seq_lens,
                            seq_lens[:, None] - 1, self.pool.page_size, self.device,
                            self.pool.dtype, ragged_own=True,
                            min_saved_keys=CASCADE_MIN_SAVED_KEYS)
        if plan is None:
            return None
        plan.own_paged = (*paged, torch.from_numpy(plan.shared_tokens.astype(np.int32)))
        return plan

    def _masks(self, query_pos_t: torch.Tensor, kv_len: int, max_extend: int,
               from_zero: bool) -> dict[int | None, torch.Tensor]:
        """Masks by sliding window from each query row's position ([B, E, 1] on the device)."""
        device = self.device
        key_pos = torch.arange(kv_len, device=device)
        # Without cached tokens, query row i sits at position i, so SDPA's own (top-left)
        # causal mask is exact, padding included, and skips the blocks above the diagonal.
        masks: dict[int | None, torch.Tensor] = {}
        for window in set(self.sliding_windows) - ({None} if from_zero else set()):
            allowed = key_pos <= query_pos_t
            if window is not None:
                allowed &= key_pos > query_pos_t - window
            # Additive float masks, built once a step: given a boolean one, SDPA converts it in
            # every layer (a `where` over [B, E, S]: 6% of an 8 x 32-row extend's attention).
            mask = torch.zeros(allowed.shape, dtype=self.pool.dtype, device=device)
            masks[window] = mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
        return masks

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if len(self._groups) == 1:
            return self._attend_group(layer, q, self._groups[0])
        out = torch.empty_like(q)
        for group in self._groups:
            out.index_copy_(
                0, group.rows, self._attend_group(layer, q.index_select(0, group.rows), group)
            )
        return out

    def _gather(self, which: int, pages: torch.Tensor, g: _Group) -> torch.Tensor:
        """``pages[g.page_table]`` into a reused buffer: a fresh multi-hundred-MB tensor per
        layer and step costs more in page faults than the copy itself (4x, measured on CPU).
        An 8-bit pool's pages are decoded as they land: only the pages this group reads
        exist in full precision, and only for this layer."""
        per_page = pages[0].numel() // pages.shape[-1] * self.head_dim
        need = len(g.page_table) * per_page
        buf = self._gather_buffers[which]
        if buf is None or buf.numel() < need:
            buf = torch.empty(need + need // 4, dtype=self.pool.dtype, device=pages.device)
            self._gather_buffers[which] = buf
        out = buf[:need].view(len(g.page_table), *pages.shape[1:-1], self.head_dim)
        if self.pool.encoded:
            out.copy_(decode(pages.index_select(0, g.page_table), self.pool.kv_dtype, out.dtype))
        else:
            torch.index_select(pages, 0, g.page_table, out=out)
        return out.view(g.num_seqs, g.kv_len, self.num_kv_heads, self.head_dim)

    def _attend_group(self, layer: int, q: torch.Tensor, g: _Group) -> torch.Tensor:
        k_pages, v_pages = self.pool.layer(layer)
        if g.paged is not None and g.cascade is None:
            indptr, indices, seq_lens, *q_indptr = g.paged
            kernel = g.kernel or self._paged_decode
            out, _ = kernel(q.contiguous(), k_pages, v_pages, indptr, indices, seq_lens,
                            self.sliding_windows[layer] or 0, self.scale, None, *q_indptr)
            return out
        if g.pad_index is not None:
            padded = q.new_zeros(g.num_seqs * g.max_extend, *q.shape[1:])
            q = padded.index_copy_(0, g.pad_index, q)
        if g.cascade is not None:
            out = attend_cascade(q.view(g.num_seqs, g.max_extend, *q.shape[1:]), k_pages,
                                 v_pages, g.cascade, self.scale, self._paged_decode,
                                 self.pool.kv_dtype).view(q.shape)
        else:
            out = self._attend_gathered(layer, q, g, k_pages, v_pages)
        return out if g.pad_index is None else out.index_select(0, g.pad_index)

    def _attend_gathered(self, layer: int, q: torch.Tensor, g: _Group, k_pages: torch.Tensor,
                         v_pages: torch.Tensor) -> torch.Tensor:
        """SDPA over the group's pages gathered dense; ``q`` padded to [B * max_extend, ...]."""
        num_kv, head_dim = self.num_kv_heads, self.head_dim
        k = self._gather(0, k_pages, g).transpose(1, 2)
        v = self._gather(1, v_pages, g).transpose(1, 2)
        mask = g.masks.get(self.sliding_windows[layer])
        if g.max_extend == 1:
            # [B, H, D] -> [B, kv_heads, group, D]: heads h = kv * group + i share KV head kv.
            q4 = q.view(g.num_seqs, num_kv, -1, head_dim)
            out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=self.scale)
            return out.reshape(q.shape)
        q4 = q.view(g.num_seqs, g.max_extend, self.num_heads, head_dim).transpose(1, 2)
        group = self.num_heads // num_kv
        if group > 1 and self.device.type == "cuda":
            # CUDA's memory-efficient SDPA takes a mask but not enable_gqa; the math fallback
            # would hold [B, heads, extend, kv_len] scores in memory.
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale,
                                             enable_gqa=k.shape[1] != self.num_heads)
        return out.transpose(1, 2).reshape(q.shape)
