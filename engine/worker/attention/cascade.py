"""Shared-prefix (cascade) decode attention for the torch backend.

Decoding sequences that share leading pages (a system prompt, a few-shot header, the samples of
one prompt) read the same KV. Gathering it once per sequence is what makes paged decode
memory-bound on CPU; here each group's shared pages are gathered and attended once, for all of
the group's queries together, and each sequence's own pages separately; the two partial
softmaxes merge through their log-sum-exps::

    seq a: [ shared p3 p7 p1 ... | a's own pages ]      o = merge(attend(q, shared), attend(q, own))
    seq b: [ shared p3 p7 p1 ... | b's own pages ]      merge by lse: exact, not an approximation

A plan reaches the device in one non-blocking copy (engine/worker/staging.py): planning never
waits for the device.

Used for decode and extend groups without sliding-window layers, when some group shares at
least ``MIN_SHARED_PAGES`` pages (a wave of requests extending one cached system prompt reads it
once instead of once per request).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.kv_quant import decode
from engine.worker.staging import to_device_many

MIN_SHARED_PAGES = 4


@dataclass
class CascadePlan:
    shared_table: torch.Tensor  # int64 [groups * max_shared] pages (padding repeats a real page)
    # float [groups, 1, 1, max_shared * P]: 0 or -inf; None when every group shares all
    # max_shared pages (nothing to hide: the fused kernel runs unmasked)
    shared_mask: torch.Tensor | None
    member_index: torch.Tensor  # int64 [groups * max_members]: seq of each slot (padding: 0)
    member_slot: torch.Tensor  # int64 [seqs in groups]: their slot in [groups * max_members]
    member_seqs: torch.Tensor  # int64 [seqs in groups]
    own_table: torch.Tensor  # int64 [B * max_own] each seq's pages after its shared run
    own_mask: torch.Tensor  # float [B, 1, E, 1, max_own * P]: causal, 0 or -inf
    num_groups: int
    max_members: int
    max_shared: int
    max_own: int
    shared_tokens: np.ndarray  # int64 [B]: tokens of each seq's shared run (0: in no group)
    saved_keys: int  # keys read once per group instead of once per member
    # The compiled CPU kernel's (indptr, indices, seq_lens, starts) when it attends the own
    # parts of a decode step (starts = shared_tokens); None: gathered and attended by SDPA.
    own_paged: tuple[torch.Tensor, ...] | None = None
    # One group of every sequence, in order (a wave of requests over one cached head): the
    # members' slots are the sequences themselves, so no rows are selected or scattered.
    whole: bool = False


def plan_cascade(table: np.ndarray, counts: np.ndarray, seq_lens: np.ndarray,
                 query_pos: np.ndarray, page_size: int, device: torch.device,
                 dtype: torch.dtype, ragged_own: bool = False, min_saved_keys: int = 0
                 ) -> CascadePlan | None:
    """Group sequences by their first page and find each group's common page run.

    ``table``: [B, max_pages] page ids, each row's first ``counts[i]`` valid; ``query_pos``:
    [B, E] the absolute position of each (padded) query row. Shared pages hold only cached
    tokens (the run ends before every member's last page and first query row's page), so
    every query sees all of them; a sequence's own pages are causal. None when no group shares enough, or when the
    savings are small (one long unshared sequence pads everyone's own part to its length;
    ``ragged_own``: the own parts are attended unpadded, by the compiled CPU kernel), or when
    sharing saves reading fewer than ``min_saved_keys`` keys."""
    num_seqs, max_pages = table.shape
    table = np.where(np.arange(max_pages)[None, :] < counts[:, None], table, -1)

    first_pages, group_of = np.unique(table[:, 0], return_inverse=True)
    shared = np.zeros(num_seqs, dtype=np.int64)
    groups: list[np.ndarray] = []
    for g in range(len(first_pages)):
        members = np.flatnonzero(group_of == g)
        if len(members) < 2:
            continue
        same = (table[members] == table[members[0]]).all(axis=0)
        # Never share a member's last page: it holds the slot this step writes; nor a page
        # holding a query row (a draft model catching two forks up on a prompt writes pages
        # they share).
        run = min(int(np.argmin(same)) if not same.all() else max_pages,
                  int(counts[members].min()) - 1,
                  int(query_pos[members].min()) // page_size)
        if run >= MIN_SHARED_PAGES:
            shared[members] = run
            groups.append(members)
    saved_keys = int(sum((len(m) - 1) * shared[m[0]] for m in groups)) * page_size
    if not groups or saved_keys < min_saved_keys:
        return None

    max_shared = max(int(shared[m[0]]) for m in groups)
    max_members = max(len(m) for m in groups)
    shared_table = np.zeros((len(groups), max_shared), dtype=np.int64)
    shared_valid = np.zeros((len(groups), max_shared * page_size), dtype=bool)
    member_index = np.zeros((len(groups), max_members), dtype=np.int64)
    member_slot, member_seqs = [], []
    for i, members in enumerate(groups):
        run = int(shared[members[0]])
        shared_table[i, :run] = table[members[0], :run]
        shared_table[i, run:] = table[members[0], 0]
        shared_valid[i, : run * page_size] = True
        member_index[i, : len(members)] = members
        member_slot.extend(i * max_members + np.arange(len(members)))
        member_seqs.extend(members)

    own_counts = counts - shared
    max_own = int(own_counts.max())
    if not ragged_own and (num_seqs * max_own + len(groups) * max_shared
                           > 0.6 * num_seqs * max_pages):
        return None
    take = np.minimum(np.arange(max_own)[None, :], own_counts[:, None] - 1) + shared[:, None]
    own_table = table[np.arange(num_seqs)[:, None], take]
    key_pos = shared[:, None] * page_size + np.arange(max_own * page_size)[None, :]
    own_valid = (key_pos < seq_lens[:, None]) & (
        np.arange(max_own * page_size)[None, :] < own_counts[:, None] * page_size)
    # [B, E, S]: causal at absolute positions.
    own_valid = own_valid[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])

    # Every array the plan puts on the device, in one non-blocking copy (no sync).
    shared_table_t, member_index_t, member_slot_t, member_seqs_t, own_table_t, shared_valid_t, \
        own_valid_t = to_device_many(
            [shared_table.reshape(-1), member_index.reshape(-1),
             np.asarray(member_slot, dtype=np.int64), np.asarray(member_seqs, dtype=np.int64),
             own_table.reshape(-1), shared_valid, own_valid], device)

    def additive(valid: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(valid.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~valid, float("-inf"))

    full = all(int(shared[m[0]]) == max_shared for m in groups)
    return CascadePlan(
        shared_table=shared_table_t,
        shared_mask=None if full else additive(shared_valid_t)[:, None, None, :],
        member_index=member_index_t, member_slot=member_slot_t,
        member_seqs=member_seqs_t, own_table=own_table_t,
        own_mask=additive(own_valid_t)[:, None, :, None, :], num_groups=len(groups),
        max_members=max_members, max_shared=max_shared, max_own=max_own,
        shared_tokens=shared * page_size,
        saved_keys=saved_keys,
        whole=len(groups) == 1 and len(groups[0]) == num_seqs,
    )


def partial_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part of the keys: (output, log-sum-exp [..., rows, 1]).

    Scores, their log-sum-exp and the weights are at least float32 whatever the activation
    dtype (in bf16 the merge by log-sum-exp made the result ~3.6x less accurate than one plain
    bf16 attention); the output is cast back to ``q``'s dtype once, the log-sum-exp stays wide
    for ``merge_partials``."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.add_(mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(scores.sub_(lse).exp_(), v.to(wide)).to(q.dtype), lse


def partial_flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through torch's fused CPU kernel, which returns the log-sum-exp and never
    holds the [rows, keys] scores (7x faster than ``partial_math`` on a shared prefix;
    unmasked, 12% faster again: 768 rows over 512 keys)."""
    if mask is not None:
        mask = mask.expand(q.shape[0], 1, q.shape[2], -1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse.unsqueeze(-1)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial softmax attentions over disjoint keys → attention over all of them.

    The weights and the sum are taken in at least float32 whatever the activation dtype (the
    fused kernel's log-sum-exp already is float32; rounding each weighted half to bf16 before
    adding would lose the digits the merge exists to keep); the result is cast once, back to
    the partial outputs' dtype."""
    wide = torch.promote_types(out_a.dtype, torch.float32)
    lse_a, lse_b = lse_a.to(wide), lse_b.to(wide)
    total = torch.logaddexp(lse_a, lse_b)
    merged = out_a.to(wide) * (lse_a - total).exp_()
    return merged.addcmul_(out_b.to(wide), (lse_b - total).exp_()).to(out_a.dtype)


def attend_cascade(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                   plan: CascadePlan, scale: float,
                   paged_decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                   kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q: [B, E, heads, D] (E query rows per sequence, padded); returns the same shape.
    ``paged_decode``: the compiled CPU kernel, which attends the own parts when the plan has
    ``own_paged`` (decode steps, E = 1). ``kv_dtype``: what the pages store (default q's)."""
    num_seqs, rows, num_heads, head_dim = q.shape
    num_kv = k_pages.shape[2]
    per_kv = num_heads // num_kv
    attend_part = partial_flash_cpu if q.device.type == "cpu" else partial_math
    # [B, kv, E * per_kv, D]: the query heads sharing a KV head attend together.
    q4 = q.view(num_seqs, rows, num_kv, per_kv, head_dim).transpose(1, 2)
    q4 = q4.reshape(num_seqs, num_kv, rows * per_kv, head_dim)

    def gather(pages: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        # [n, kv, S, D] as a strided view: the fused kernel reads it as is (a copy measured no faster).
        # An 8-bit pool's pages are decoded here: only the pages this part reads.
        selected = pages.index_select(0, table)
        if kv_dtype not in (None, q.dtype):
            selected = decode(selected, kv_dtype, q.dtype)
        return selected.view(n, -1, num_kv, head_dim).transpose(1, 2)

    if plan.own_paged is not None and paged_decode is not None:
        # Heads h = kv * per_kv + i: the kernel's [B, heads] rows are q4's for E = 1.
        indptr, indices, seq_lens, starts = plan.own_paged
        own_out, own_lse = paged_decode(q.reshape(num_seqs, num_heads, head_dim).contiguous(),
                                        k_pages, v_pages, indptr, indices, seq_lens, 0, scale,
                                        starts)
        own_out = own_out.view(num_seqs, num_kv, per_kv, head_dim)
        own_lse = own_lse.view(num_seqs, num_kv, per_kv, 1)
    else:
        own_mask = plan.own_mask.expand(-1, -1, -1, per_kv, -1).reshape(
            num_seqs, 1, rows * per_kv, -1)
        own_out, own_lse = attend_part(q4, gather(k_pages, plan.own_table, num_seqs),
                                       gather(v_pages, plan.own_table, num_seqs), own_mask, scale)
    # Each group's shared pages, once, for all its members' queries together.
    groups, members = plan.num_groups, plan.max_members
    width = rows * per_kv
    qg = q4 if plan.whole else q4.index_select(0, plan.member_index)
    qg = qg.view(groups, members, num_kv, width, head_dim).transpose(1, 2).reshape(
        groups, num_kv, members * width, head_dim)
    shared_out, shared_lse = attend_part(qg, gather(k_pages, plan.shared_table, groups),
                                         gather(v_pages, plan.shared_table, groups),
                                         plan.shared_mask, scale)

    def per_member(x: torch.Tensor) -> torch.Tensor:
        x = x.view(groups, num_kv, members, width, -1).transpose(1, 2)
        x = x.reshape(groups * members, num_kv, width, -1)
        return x if plan.whole else x.index_select(0, plan.member_slot)

    s_out, s_lse = per_member(shared_out), per_member(shared_lse)
    if plan.whole:
        own_out = merge_partials(s_out, s_lse, own_out, own_lse)
    else:
        seqs = plan.member_seqs
        o_out, o_lse = own_out.index_select(0, seqs), own_lse.index_select(0, seqs)
        own_out.index_copy_(0, seqs, merge_partials(s_out, s_lse, o_out, o_lse))
    out = own_out.view(num_seqs, num_kv, rows, per_kv, head_dim).transpose(1, 2)
    return out.reshape(num_seqs, rows, num_heads, head_dim)
