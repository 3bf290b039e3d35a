"""One forward step as plain arrays: what the scheduler sends and the model runner executes.

Page convention (see DESIGN.md, "Memory model"): the KV of token position ``i`` of a sequence
lives in slot ``pages[i // P] * P + i % P``, so a sequence's pages are listed in position order
and its last page holds ``seq_len - (len(pages) - 1) * P`` tokens.

One sequence in a step::

    positions  0 ........ cached_len-1 | cached_len ...... seq_len-1
               [ KV already in pages    | new tokens: written to out_slots ]
    pages      [p3][p7][p1]...          (ceil(seq_len / P) of them, position order)

The scheduler decides every page number; the runner only reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

PageTable = Sequence[int] | np.ndarray


def _empty_pairs(width: int) -> np.ndarray:
    return np.zeros((0, width), dtype=np.int32)


class BatchInput(msgspec.Struct, kw_only=True):
    """The one description of a step: built once by ``StepBuilder`` in the scheduler, sent to
    the worker inside a ``ForwardBatch`` (int32 arrays travel as msgpack extensions, see
    engine/contracts/protocol.py), validated and run by the model runner."""

    input_ids: np.ndarray  # int32 [T] new tokens of all sequences, concatenated in batch order
    positions: np.ndarray  # int32 [T] absolute positions (cached_len + j)
    extend_lens: np.ndarray  # int32 [B] new tokens per sequence this step (1 for a decode)
    seq_lens: np.ndarray  # int32 [B] tokens in the KV after this step (cached_len + extend_len)
    page_indptr: np.ndarray  # int32 [B+1] CSR offsets into page_indices
    page_indices: np.ndarray  # int32 each sequence's pages in position order
    out_slots: np.ndarray  # int32 [T] KV slot each new token is written to
    logits_rows: np.ndarray | None = None  # int32 rows of [T]; None: last new token of each seq
    copies: np.ndarray = msgspec.field(default_factory=lambda: _empty_pairs(3))  # (src, dst, n)
    swap_out: np.ndarray = msgspec.field(default_factory=lambda: _empty_pairs(2))  # (dev, host)
    swap_in: np.ndarray = msgspec.field(default_factory=lambda: _empty_pairs(2))  # (host, dev)
    # A model with sliding-window layers whose KV has pages of its own (radix/sliding.py): the
    # sliding pages of page_indices (0 where gone: before every window of the step), of
    # out_slots and of copies; empty otherwise
    swa_page_indices: np.ndarray = msgspec.field(default_factory=lambda: _ints([]))
    swa_out_slots: np.ndarray = msgspec.field(default_factory=lambda: _ints([]))
    swa_copies: np.ndarray = msgspec.field(default_factory=lambda: _empty_pairs(3))
    # and the sliding pages a swap moves with its full pages: (sliding page, host page) out,
    # (host page, sliding page) in, where host page h is the sliding part of swap page h
    swa_swap_out: np.ndarray = msgspec.field(default_factory=lambda: _empty_pairs(2))
    swa_swap_in: np.ndarray = msgspec.field(default_factory=lambda: _empty_pairs(2))
    # int32 [B] each sequence's LoRA adapter (engine/contracts/lora.py; 0: the base model);
    # empty when every sequence runs the base model
    lora_ids: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    # int32 [B] the drafts the draft model proposes for each sequence in the worker (its last
    # that many new ids are placeholders, engine/worker/draft.py); empty when none does
    draft_lens: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the shape decode kernels want)."""
        return bool(np.all(self.extend_lens == 1))

    @property
    def has_sliding_pages(self) -> bool:
        return len(self.swa_out_slots) > 0

    def sliding_view(self) -> BatchInput:
        """The step as the sliding-window layers see it: their pages and slots in place of the
        full layers'."""
        return msgspec.structs.replace(self, page_indices=self.swa_page_indices,
                                       out_slots=self.swa_out_slots, copies=self.swa_copies)

    def resolved_logits_rows(self) -> np.ndarray:
        if self.logits_rows is not None:
            return np.asarray(self.logits_rows, dtype=np.int64)
        return np.cumsum(self.extend_lens, dtype=np.int64) - 1

    def last_page_lens(self, page_size: int) -> np.ndarray:
        num_pages = np.diff(self.page_indptr)
        return (self.seq_lens - (num_pages - 1) * page_size).astype(np.int32)

    @classmethod
    def build(cls, seqs: Sequence[tuple[PageTable, int, Sequence[int] | np.ndarray]],
              page_size: int, logits: Literal["last", "all"] = "last", *,
              copies: Sequence[tuple[int, int, int]] | np.ndarray | None = None,
              swap_out: Sequence[tuple[int, int]] | np.ndarray | None = None,
              swap_in: Sequence[tuple[int, int]] | np.ndarray | None = None) -> BatchInput:
        """Assemble a batch from per-sequence ``(pages, cached_len, new_ids)`` (see
        ``StepBuilder.add``); ``logits="all"`` asks for every new token's logits."""
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        builder = StepBuilder(page_size)
        for pages, cached_len, new_ids in seqs:
            builder.add(pages, cached_len, new_ids)
        return builder.finish(copies, swap_out, swap_in, all_logits=logits == "all")

    def validate(self, page_size: int, num_pages: int, num_host_pages: int = 0,
                 num_sliding_pages: int = 0, num_sliding_host_pages: int = 0) -> None:
        """Raise ValueError if the arrays disagree with each other or with the page convention
        (the sliding-window layers' pages too, when the pool has ``num_sliding_pages``).

        O(B + T) numpy work: cheap next to a forward, and it turns a scheduler bug into a
        sentence instead of silently attending over the wrong slots.
        """
        num_seqs, num_tokens = self.num_seqs, self.num_tokens
        for name in ("positions", "out_slots"):
            if len(getattr(self, name)) != num_tokens:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for "
                                 f"{num_tokens} tokens")
        if len(self.seq_lens) != num_seqs or len(self.page_indptr) != num_seqs + 1:
            raise ValueError("extend_lens, seq_lens and page_indptr disagree on the number of "
                             "sequences")
        if len(self.lora_ids) not in (0, num_seqs) or np.any(self.lora_ids < 0):
            raise ValueError("lora_ids must be empty or one adapter id (>= 0) per sequence")
        if len(self.draft_lens) not in (0, num_seqs) or np.any(self.draft_lens < 0) or (
                len(self.draft_lens) and np.any(self.draft_lens >= self.extend_lens)):
            raise ValueError("draft_lens must be empty or, per sequence, fewer drafts than new "
                             "tokens")
        if num_seqs == 0 and num_tokens == 0:
            self._validate_moves(page_size, num_pages, num_host_pages)
            self._validate_sliding_swaps(num_sliding_pages, num_sliding_host_pages)
            return  # a step that only moves pages (the disk tier's)
        if num_seqs == 0 or np.any(self.extend_lens < 1):
            raise ValueError("every sequence in a batch needs at least one new token")
        if int(self.extend_lens.sum()) != num_tokens:
            raise ValueError(f"extend_lens sum to {self.extend_lens.sum()} but there are "
                             f"{num_tokens} tokens")
        if np.any(self.seq_lens < self.extend_lens):
            raise ValueError("a sequence's seq_len is smaller than its extend_len")
        pages_per_seq = np.diff(self.page_indptr)
        if np.any(pages_per_seq != -(-self.seq_lens // page_size)) or (
                self.page_indptr[-1] != len(self.page_indices)):
            raise ValueError(f"each sequence needs exactly ceil(seq_len / {page_size}) pages")
        _check_range("page_indices", self.page_indices, num_pages)
        # Recompute every new token's position and slot from the page table.
        seq_of_token = np.repeat(np.arange(num_seqs), self.extend_lens)
        first_new = np.cumsum(self.extend_lens) - self.extend_lens
        offset = np.arange(num_tokens) - first_new[seq_of_token]
        expected_pos = (self.seq_lens - self.extend_lens)[seq_of_token] + offset
        if np.any(self.positions != expected_pos):
            raise ValueError("positions must be cached_len + j for the j-th new token of each "
                             "sequence")
        page = self.page_indices[self.page_indptr[seq_of_token] + expected_pos // page_size]
        if np.any(self.out_slots != page * page_size + expected_pos % page_size):
            raise ValueError("out_slots disagree with the page table "
                             "(slot = pages[i // P] * P + i % P)")
        rows = self.resolved_logits_rows()
        if len(rows) and (rows.min() < 0 or rows.max() >= num_tokens):
            raise ValueError(f"logits_rows must lie in [0, {num_tokens})")
        self._validate_moves(page_size, num_pages, num_host_pages)
        if num_sliding_pages or self.has_sliding_pages:
            self._validate_sliding(page_size, num_sliding_pages)
        self._validate_sliding_swaps(num_sliding_pages, num_sliding_host_pages)

    def _validate_sliding(self, page_size: int, num_sliding_pages: int) -> None:
        if not num_sliding_pages:
            raise ValueError("the step names sliding-window pages but the pool has none")
        if (len(self.swa_page_indices) != len(self.page_indices)
                or len(self.swa_out_slots) != len(self.out_slots)
                or len(self.swa_copies) != len(self.copies)):
            raise ValueError("the sliding-window pages must match the step's pages, slots and "
                             "copies one for one")
        _check_range("sliding page_indices", self.swa_page_indices, num_sliding_pages)
        _check_range("sliding out_slots", self.swa_out_slots, num_sliding_pages * page_size)
        if len(self.swa_copies):
            _check_range("sliding copy pages", self.swa_copies[:, :2], num_sliding_pages)

    def _validate_moves(self, page_size: int, num_pages: int, num_host_pages: int) -> None:
        if len(self.copies):
            _check_range("copy pages", self.copies[:, :2], num_pages)
            if np.any(self.copies[:, 2] < 1) or np.any(self.copies[:, 2] > page_size):
                raise ValueError(f"a copy moves between 1 and {page_size} slots")
        _check_swaps("", self.swap_out, self.swap_in, num_pages, num_host_pages)

    def _validate_sliding_swaps(self, num_sliding_pages: int, num_host_pages: int) -> None:
        _check_swaps("sliding ", self.swa_swap_out, self.swa_swap_in, num_sliding_pages,
                     num_host_pages)


class StepBuilder:
    """Builds a ``BatchInput`` one sequence at a time: plain lists, then one array each (a
    decode entry is a handful of ints, and per-entry numpy calls would cost more than the
    values: 256 decodes, 8 ms -> 1 ms per step). The only place the slot formula is written."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ids: list[int] = []
        self._positions: list[int] = []
        self._slots: list[int] = []
        self._pages: list[int] = []
        self._indptr = [0]
        self._extend_lens: list[int] = []
        self._seq_lens: list[int] = []
        self._rows: list[int] = []
        self._lora_ids: list[int] = []
        self._draft_lens: list[int] = []

    def add(self, pages: PageTable, cached_len: int, new_ids: Sequence[int] | np.ndarray,
            samples: int = 1, *, num_drafts: int = 0, lora_id: int = 0,
            model_drafts: bool = False) -> None:
        """One sequence: KV for ``[0, cached_len)`` already in ``pages`` (position order, covering
        at least ``cached_len + len(new_ids)`` tokens; extra trailing pages are ignored), the new
        tokens' KV written to the slots this computes; ``samples`` logits rows of its last new
        token (0 mid-prefill, n for parallel samples sharing one prefill). ``num_drafts``: the
        last that many new ids are draft tokens to verify, and the sequence gets one logits row
        for each of its last ``num_drafts + 1`` new tokens instead (``samples`` is ignored).
        ``lora_id``: the LoRA adapter it runs under (0: the base model); ``model_drafts``: the
        draft model proposes the drafts (their ids here are placeholders)."""
        num_new = len(new_ids)
        if num_new == 0:
            raise ValueError(f"sequence {len(self._extend_lens)} has no new tokens; every "
                             "sequence needs at least one")
        page_size = self.page_size
        end = cached_len + num_new
        needed = -(-end // page_size)
        if len(pages) < needed:
            raise ValueError(f"sequence {len(self._extend_lens)} has {end} tokens, which need "
                             f"{needed} pages of {page_size}, but only {len(pages)} pages were "
                             "given")
        table = pages[:needed]
        if isinstance(new_ids, np.ndarray):
            new_ids = new_ids.tolist()
        if num_new == 1:
            self._positions.append(cached_len)
            self._slots.append(int(table[cached_len // page_size]) * page_size
                               + cached_len % page_size)
        else:
            pos = np.arange(cached_len, end)
            self._positions.extend(range(cached_len, end))
            self._slots.extend((np.asarray(table, dtype=np.int64)[pos // page_size] * page_size
                                + pos % page_size).tolist())
        self._ids.extend(new_ids)
        self._pages.extend(table)
        self._indptr.append(len(self._pages))
        self._extend_lens.append(num_new)
        self._seq_lens.append(end)
        self._lora_ids.append(lora_id)
        self._draft_lens.append(num_drafts if model_drafts else 0)
        if num_drafts:
            last = len(self._ids) - 1
            self._rows.extend(range(last - num_drafts, last + 1))
        elif samples:
            self._rows.extend([len(self._ids) - 1] * samples)

    def finish(self, copies=None, swap_out=None, swap_in=None, *,
               all_logits: bool = False) -> BatchInput:
        """The batch; ``all_logits`` asks for every new token's logits instead of the rows
        ``add`` listed."""
        rows = np.arange(len(self._ids)) if all_logits else self._rows
        return BatchInput(
            input_ids=_ints(self._ids), positions=_ints(self._positions),
            extend_lens=_ints(self._extend_lens), seq_lens=_ints(self._seq_lens),
            page_indptr=_ints(self._indptr), page_indices=_ints(self._pages),
            out_slots=_ints(self._slots), logits_rows=_ints(rows), copies=_pairs(copies, 3),
            swap_out=_pairs(swap_out, 2), swap_in=_pairs(swap_in, 2),
            lora_ids=_ints(self._lora_ids if any(self._lora_ids) else []),
            draft_lens=_ints(self._draft_lens if any(self._draft_lens) else []))


def _ints(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _pairs(value: Sequence[Sequence[int]] | np.ndarray | None, width: int) -> np.ndarray:
    if value is None or len(value) == 0:
        return _empty_pairs(width)
    return np.asarray(value, dtype=np.int32).reshape(-1, width)


def _check_swaps(kind: str, swap_out: np.ndarray, swap_in: np.ndarray, num_pages: int,
                 num_host_pages: int) -> None:
    for name, pairs, host_col in (("swap_out", swap_out, 1), ("swap_in", swap_in, 0)):
        if len(pairs):
            _check_range(f"{kind}{name} host pages", pairs[:, host_col], num_host_pages)
            _check_range(f"{kind}{name} device pages", pairs[:, 1 - host_col], num_pages)


def _check_range(name: str, values: np.ndarray, limit: int) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        raise ValueError(f"{name} must lie in [0, {limit}), got {values.min()}..{values.max()}")
