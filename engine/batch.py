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
from dataclasses import dataclass, field
from typing import Literal

import numpy as np


def _empty_pairs(width: int) -> np.ndarray:
    return np.zeros((0, width), dtype=np.int32)


@dataclass
class BatchInput:
    input_ids: np.ndarray  # int32 [T] new tokens of all sequences, concatenated in batch order
    positions: np.ndarray  # int32 [T] absolute positions (cached_len + j)
    extend_lens: np.ndarray  # int32 [B] new tokens per sequence this step (1 for a decode)
    seq_lens: np.ndarray  # int32 [B] tokens in the KV after this step (cached_len + extend_len)
    page_indptr: np.ndarray  # int32 [B+1] CSR offsets into page_indices
    page_indices: np.ndarray  # int32 each sequence's pages in position order
    out_slots: np.ndarray  # int32 [T] KV slot each new token is written to
    logits_rows: np.ndarray | None = None  # int32 rows of [T]; None: last new token of each seq
    copies: np.ndarray = field(default_factory=lambda: _empty_pairs(3))  # (src, dst, num_slots)
    swap_out: np.ndarray = field(default_factory=lambda: _empty_pairs(2))  # (device, host page)
    swap_in: np.ndarray = field(default_factory=lambda: _empty_pairs(2))  # (host, device page)

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

    def resolved_logits_rows(self) -> np.ndarray:
        if self.logits_rows is not None:
            return np.asarray(self.logits_rows, dtype=np.int64)
        return np.cumsum(self.extend_lens, dtype=np.int64) - 1

    def last_page_lens(self, page_size: int) -> np.ndarray:
        num_pages = np.diff(self.page_indptr)
        return (self.seq_lens - (num_pages - 1) * page_size).astype(np.int32)

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[Sequence[int] | np.ndarray, int, Sequence[int] | np.ndarray]],
        page_size: int,
        logits: Literal["last", "all"] = "last",
        *,
        copies: Sequence[tuple[int, int, int]] | np.ndarray | None = None,
        swap_out: Sequence[tuple[int, int]] | np.ndarray | None = None,
        swap_in: Sequence[tuple[int, int]] | np.ndarray | None = None,
    ) -> BatchInput:
        """Assemble a batch from per-sequence ``(pages, cached_len, new_ids)``.

        ``pages`` lists the sequence's pages in position order and must cover
        ``cached_len + len(new_ids)`` tokens; extra trailing pages (allocated ahead) are ignored.
        """
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        ids, positions, slots, page_lists = [], [], [], []
        extend_lens = np.zeros(len(seqs), dtype=np.int32)
        seq_lens = np.zeros(len(seqs), dtype=np.int32)
        for b, (pages, cached_len, new_ids) in enumerate(seqs):
            new_ids = np.asarray(new_ids, dtype=np.int32)
            if len(new_ids) == 0:
                raise ValueError(
                    f"sequence {b} has no new tokens; every sequence needs at least one"
                )
            seq_len = cached_len + len(new_ids)
            needed = -(-seq_len // page_size)
            pages = np.asarray(pages, dtype=np.int32)
            if len(pages) < needed:
                raise ValueError(
                    f"sequence {b} has {seq_len} tokens, which need {needed} pages of "
                    f"{page_size}, but only {len(pages)} pages were given"
                )
            pages = pages[:needed]
            pos = np.arange(cached_len, seq_len, dtype=np.int32)
            ids.append(new_ids)
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
            page_lists.append(pages)
            extend_lens[b] = len(new_ids)
            seq_lens[b] = seq_len
        page_indptr = np.zeros(len(seqs) + 1, dtype=np.int32)
        page_indptr[1:] = np.cumsum([len(p) for p in page_lists])
        num_tokens = int(extend_lens.sum())
        return cls(
            input_ids=np.concatenate(ids),
            positions=np.concatenate(positions),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            page_indptr=page_indptr,
            page_indices=np.concatenate(page_lists),
            out_slots=np.concatenate(slots).astype(np.int32),
            logits_rows=np.arange(num_tokens, dtype=np.int32) if logits == "all" else None,
            copies=_pairs(copies, 3),
            swap_out=_pairs(swap_out, 2),
            swap_in=_pairs(swap_in, 2),
        )

    def validate(self, page_size: int, num_pages: int, num_host_pages: int = 0) -> None:
        """Raise ValueError if the arrays disagree with each other or with the page convention.

        O(B + T) numpy work: cheap next to a forward, and it turns a scheduler bug into a
        sentence instead of silently attending over the wrong slots.
        """
        num_seqs, num_tokens = self.num_seqs, self.num_tokens
        for name in ("positions", "out_slots"):
            if len(getattr(self, name)) != num_tokens:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries for {num_tokens} tokens"
                )
        if len(self.seq_lens) != num_seqs or len(self.page_indptr) != num_seqs + 1:
            raise ValueError(
                "extend_lens, seq_lens and page_indptr disagree on the number of sequences"
            )
        if num_seqs == 0 or np.any(self.extend_lens < 1):
            raise ValueError("every sequence in a batch needs at least one new token")
        if int(self.extend_lens.sum()) != num_tokens:
            raise ValueError(
                f"extend_lens sum to {self.extend_lens.sum()} but there are {num_tokens} tokens"
            )
        if np.any(self.seq_lens < self.extend_lens):
            raise ValueError("a sequence's seq_len is smaller than its extend_len")
        pages_per_seq = np.diff(self.page_indptr)
        if np.any(pages_per_seq != -(-self.seq_lens // page_size)) or self.page_indptr[-1] != len(
            self.page_indices
        ):
            raise ValueError(f"each sequence needs exactly ceil(seq_len / {page_size}) pages")
        _check_range("page_indices", self.page_indices, num_pages)
        # Recompute every new token's position and slot from the page table.
        seq_of_token = np.repeat(np.arange(num_seqs), self.extend_lens)
        first_new = np.cumsum(self.extend_lens) - self.extend_lens
        offset = np.arange(num_tokens) - first_new[seq_of_token]
        expected_pos = (self.seq_lens - self.extend_lens)[seq_of_token] + offset
        if np.any(self.positions != expected_pos):
            raise ValueError(
                "positions must be cached_len + j for the j-th new token of each sequence"
            )
        page = self.page_indices[self.page_indptr[seq_of_token] + expected_pos // page_size]
        if np.any(self.out_slots != page * page_size + expected_pos % page_size):
            raise ValueError(
                "out_slots disagree with the page table (slot = pages[i // P] * P + i % P)"
            )
        rows = self.resolved_logits_rows()
        if len(rows) and (rows.min() < 0 or rows.max() >= num_tokens):
            raise ValueError(f"logits_rows must lie in [0, {num_tokens})")
        if len(self.copies):
            _check_range("copy pages", self.copies[:, :2], num_pages)
            if np.any(self.copies[:, 2] < 1) or np.any(self.copies[:, 2] > page_size):
                raise ValueError(f"a copy moves between 1 and {page_size} slots")
        for name, pairs, host_col in (("swap_out", self.swap_out, 1), ("swap_in", self.swap_in, 0)):
            if len(pairs):
                _check_range(f"{name} host pages", pairs[:, host_col], num_host_pages)
                _check_range(f"{name} device pages", pairs[:, 1 - host_col], num_pages)


def _pairs(value: Sequence[Sequence[int]] | np.ndarray | None, width: int) -> np.ndarray:
    if value is None or len(value) == 0:
        return _empty_pairs(width)
    return np.asarray(value, dtype=np.int32).reshape(-1, width)


def _check_range(name: str, values: np.ndarray, limit: int) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        raise ValueError(f"{name} must lie in [0, {limit}), got {values.min()}..{values.max()}")
