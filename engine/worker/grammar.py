"""Constrained sampling in the model worker: one grammar state per constrained sequence.

A constrained row (``RowSampling.grammar_key``, its ``params.structured_outputs``) gets a
matcher the first time its sequence is sampled (compiled by llguidance in about a millisecond;
engine/contracts/structured.py says what each constraint means). Each step:

1. ``start_masks`` (before the forward): on a host thread, each constrained row's matcher fills
   its row of a token bitmask (llguidance releases the GIL), while the forward runs;
2. ``allowed`` (after it): the bitmask as a [rows, vocab] bool tensor on the logits' device,
   which the sampler applies before choosing (engine/worker/sampler.py);
3. ``advance`` (after sampling): each matcher consumes its sampled token, then the tokens the
   grammar forces next (several at once: ``compute_ff_tokens``), which go back to the scheduler
   to be appended and run as one extend in the next step instead of one step each. A row that
   asks for logprobs gets no forced tokens (a forced token has no distribution of its own): its
   mask admits only that token, one step each. A grammar that can take nothing more ends its
   sequence ("stop").

A constrained sequence verifying drafts (speculation) has one row per draft and one after them,
of one grammar key: its drafts are kept while the grammar allows them (``cut_drafts``, after
the draft model made its own under the grammar, ``guide``), each row's mask is the grammar's
state after the drafts before it, and ``advance`` takes the tokens the verification emits
(engine/worker/grammar_drafts.py).

A grammar that fails to compile here (the tokenizer worker checked it against the tokenizer's
own vocabulary; the model's, or its end tokens, can differ) fails its own row alone:
``start_masks`` leaves it out of the mask and names it in ``Masks.failed``, the result carries
the reason (``BatchResult.grammar_failures``), and the scheduler ends that request with a 400
while the rows beside it go on.

Matchers live until the scheduler releases their sequence (``ForwardBatch.released_grammars``).
Preemption keeps them: a resumed sequence's outputs are the tokens its matcher consumed. The
scheduler never plans a look-ahead step behind a constrained row (forced tokens change what
the next step runs), so rows arrive here in step with their matcher: ``output_len`` is the
count it consumed (a matcher that consumed more, for a step the scheduler dropped, rolls back).

The grammar engine's view of the vocabulary takes about a second of CPU to build: the worker
process starts building it on the grammar thread once it reports ready (``prepare``), so the
first constrained request does not stall every other request's step; a worker made without
that (the tests') builds it on first use.
"""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.contracts.structured import grammar_text, grammar_tokenizer, parser_limits
from engine.contracts.tokenizer import load_tokenizer
from engine.contracts.worker_messages import RowSampling
from engine.worker.grammar_drafts import (
    DraftWalk,
    Guide,
    Verify,
    cut_drafts,
    emitted,
    fill_verify_rows,
)
from engine.worker.staging import to_device

logger = logging.getLogger("radixserve.worker")


@dataclass
class _State:
    matcher: object  # llguidance.LLMatcher
    consumed: int = 0  # output tokens it has consumed


class GrammarRejected(ValueError):
    """A constrained row's grammar does not compile against the model's vocabulary."""


@dataclass
class Masks:
    """One step's constrained rows (indices into the step's sampling rows), the future of their
    bitmask, int32 [len(rows), ceil(vocab / 32)], and the seconds filling it took; ``failed``:
    rows whose grammar did not compile (row: why), left out of ``rows``; ``verifies``: the
    constrained sequences verifying drafts (their rows' masks filled by ``cut_drafts``)."""

    rows: list[int]
    bitmask: np.ndarray
    done: Future
    seconds: float = 0.0
    failed: dict[int, str] = field(default_factory=dict)
    verifies: list[Verify] = field(default_factory=list)


@dataclass
class Advanced:
    """What the grammar added after a step's samples: forced tokens per sampling row, and the
    rows whose grammar ended."""

    forced: dict[int, list[int]]
    ended: list[int]


class Grammars:
    def __init__(self, model_dir: str, vocab_size: int, eos_ids: list[int]) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, list(eos_ids)
        self.states: dict[str, _State] = {}
        self._tokenizer = None
        self._building: Future | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self.forced_tokens = 0  # forced tokens handed out (the scheduler counts them too)

    def prepare(self) -> None:
        """Start building the grammar engine's view of the vocabulary on the grammar thread."""
        if self._building is None:
            self._building = self._thread.submit(self._build)

    def _build(self):
        began = time.perf_counter()
        tokenizer = grammar_tokenizer(load_tokenizer(self.model_dir), self.vocab_size,
                                      self.eos_ids)
        logger.info("grammar engine ready for this vocabulary in %.1f s",
                    time.perf_counter() - began)
        return tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._building.result() if self._building else self._build()
        return self._tokenizer

    def release(self, keys: list[str]) -> None:
        for key in keys:
            self.states.pop(key, None)

    def _state(self, row: RowSampling) -> _State:
        import llguidance

        state = self.states.get(row.grammar_key)
        if state is None:
            if row.output_len:
                raise RuntimeError(f"constrained sequence {row.grammar_key} has "
                                   f"{row.output_len} outputs but no grammar state here")
            spec = row.params.structured_outputs
            try:
                matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0,
                                               limits=parser_limits())
                error = matcher.get_error() if matcher.is_error() else None
            except (ValueError, RuntimeError) as exc:
                error = str(exc)
            if error is not None:
                raise GrammarRejected(f"structured_outputs.{spec.kind} does not compile for "
                                      f"this model's vocabulary: {' '.join(error.split())[:400]}")
            state = self.states[row.grammar_key] = _State(matcher)
        if state.consumed > row.output_len:
            state.matcher.rollback(state.consumed - row.output_len)
            state.consumed = row.output_len
        if state.consumed != row.output_len:
            raise RuntimeError(f"constrained sequence {row.grammar_key} is at output "
                               f"{row.output_len}, its grammar at {state.consumed}")
        return state

    def start_masks(self, rows: list[RowSampling], step=None) -> Masks | None:
        """Each constrained row's bitmask, filled on the grammar thread; None when no row is
        constrained. A row's state is checked (and made) here, on the caller's thread; a row
        whose grammar does not compile goes to ``Masks.failed`` instead. Consecutive rows of
        one grammar key are a verification of drafts (sequence of ``step``, the step being
        run): their masks wait for the drafts (``cut_drafts``)."""
        import llguidance.numpy as llnp

        groups: list[list[int]] = []  # [first row, rows] per constrained sequence
        for i, row in enumerate(rows):
            if not row.grammar_key:
                continue
            if groups and sum(groups[-1]) == i and rows[i - 1].grammar_key == row.grammar_key:
                groups[-1][1] += 1
            else:
                groups.append([i, 1])
        constrained, matchers, failed, verifies = [], [], {}, []
        for first, count in groups:
            try:
                state = self._state(rows[first])
            except GrammarRejected as exc:
                logger.info("constrained sequence %s refused: %s", rows[first].grammar_key, exc)
                failed[first] = str(exc)
                continue
            if count == 1:
                matchers.append((state.matcher, len(constrained)))
            else:
                seq = int(np.searchsorted(np.cumsum(step.extend_lens),
                                          step.resolved_logits_rows()[first], side="right"))
                walk = DraftWalk(state.matcher, rows[first].params.logprobs is None)
                verifies.append(Verify(first, count, len(constrained), seq, walk))
            constrained.extend(range(first, first + count))
        if not constrained and not failed:
            return None
        bitmask = llnp.allocate_token_bitmask(len(constrained), self.vocab_size)
        masks = Masks(constrained, bitmask, Future(), failed=failed, verifies=verifies)

        def fill() -> None:
            began = time.perf_counter()
            for matcher, i in matchers:
                llnp.fill_next_token_bitmask(matcher, bitmask, i)
            masks.seconds = time.perf_counter() - began

        masks.done = self._thread.submit(fill)
        return masks

    def guide(self, masks: Masks | None) -> Guide | None:
        """What the draft model's drafting asks of the verifying sequences' grammars."""
        if masks is None or not masks.verifies:
            return None
        import llguidance.numpy as llnp

        return Guide(masks.verifies, self.vocab_size, llnp.fill_next_token_bitmask, self.unpack)

    def cut_drafts(self, masks: Masks, step, unused: np.ndarray) -> np.ndarray:
        """The drafts each verifying sequence's grammar keeps (engine/worker/grammar_drafts.py;
        the last ``unused[seq]`` of a sequence's never made); their rows' masks filled on the
        grammar thread after the others. Returns per sequence of ``step`` the drafts cut."""
        import llguidance.numpy as llnp

        cut = cut_drafts(masks.verifies, step, unused)
        before = masks.done

        def fill() -> None:
            before.result()
            began = time.perf_counter()
            fill_verify_rows(masks.verifies, masks.bitmask, llnp.fill_next_token_bitmask)
            masks.seconds += time.perf_counter() - began

        masks.done = self._thread.submit(fill)
        return cut

    def allowed(self, masks: Masks, device: torch.device, vocab: int) -> torch.Tensor:
        """[len(masks.rows), vocab] bool: the tokens each constrained row may take. A row its
        grammar leaves nothing (it should not happen) may take an end-of-sequence token."""
        masks.done.result()
        return self.unpack(masks.bitmask, device, vocab)

    def unpack(self, bitmask: np.ndarray, device: torch.device, vocab: int) -> torch.Tensor:
        """A token bitmask as [rows, vocab] bool on ``device`` (an empty row: an end token)."""
        if device.type == "cpu" and sys.byteorder == "little":
            # Bit j of word w is token 32 w + j: on a little-endian host the words' bytes,
            # unpacked low bit first, are the tokens in order (20x faster than shifting).
            unpacked = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
            allowed = torch.from_numpy(unpacked[:, :vocab]).view(torch.bool)
        else:
            bits = to_device(bitmask, device)
            shifts = self._shifts.get(device)
            if shifts is None:
                shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
            allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
        empty = ~allowed.any(-1)
        if self.eos_ids:
            allowed[:, self.eos_ids[0]] |= empty
        return allowed

    def advance(self, rows: list[RowSampling], masks: Masks, tokens: np.ndarray) -> Advanced:
        """Each constrained row's matcher takes its sampled token (a verification's: the
        tokens it emits, reported at the row of the last), then what the grammar forces
        (within ``max_tokens``; none for rows that report logprobs)."""
        forced: dict[int, list[int]] = {}
        ended: list[int] = []
        verifies = {v.first: v for v in masks.verifies}
        inside = {r for v in masks.verifies for r in range(v.first + 1, v.first + v.rows)}
        for i in masks.rows:
            if i in inside:
                continue
            new = emitted(verifies[i], tokens) if i in verifies else [int(tokens[i])]
            i += len(new) - 1
            row = rows[i]
            state = self.states[row.grammar_key]
            matcher = state.matcher
            if not matcher.consume_tokens(new):
                ended.append(i)  # the token broke the grammar (only an end token can)
                continue
            state.consumed += len(new)
            room = row.params.max_tokens - state.consumed
            if not matcher.is_stopped() and row.params.logprobs is None and room > 0:
                extra = list(matcher.compute_ff_tokens())[:room]
                if extra and matcher.consume_tokens(extra):
                    state.consumed += len(extra)
                    forced[i] = extra
                    self.forced_tokens += len(extra)
            if matcher.is_stopped():
                ended.append(i)
        return Advanced(forced, ended)
