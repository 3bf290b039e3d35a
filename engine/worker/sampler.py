"""Token sampling on the logits' device, vectorised over the batch.

Pipeline for one step::

    raw logits ──▶ logprobs / top-N logprobs (reported from the *raw* logits)
        │
        ├─ constrained rows: tokens their grammar forbids to -inf (engine/worker/grammar.py)
        ├─ penalties: repetition (prompt + output), frequency, presence
        ├─ greedy rows (temperature 0 or top_k 1): argmax, no random draw at all
        └─ random rows: / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ exponential race

Sampling is an exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` per token, which
picks token i with probability ``probs[i]``. A seeded row draws ``E`` from a generator seeded
only by ``(seed, len(output_ids))``, so its token depends on nothing but its seed, its step and
its logits: the same seed gives the same text whatever else is in the batch and however often
the request was preempted and resumed. Unseeded rows draw from torch's default generator for the
device (``torch.manual_seed`` makes them reproducible in tests).

Per-request Python work builds the small parameter tensors; everything per token is torch ops.

Sync points: one per step. Everything shape-related (how many top-k candidates to rank, how
many top logprobs to report) is decided on the host from the rows' ``SamplingParams``; the small
parameter and index arrays go to the device as non-blocking copies from pinned memory; seeded
rows re-seed one generator per device instead of creating one each; and every result comes back
in a single device-to-host copy (``_to_host``) at the end of ``sample``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine.contracts.sampling_params import SamplingParams
from engine.worker.staging import to_device

_MASK64 = (1 << 64) - 1


@dataclass
class RowState:
    """One row's sampling parameters and token history, for this step (the worker builds it
    from the wire's ``RowSampling``).

    ``params.logprobs`` sets how many top logprobs the row wants; beam search asks for
    ``2 * beam_width`` (up to 64) by passing a copy of its params with that value. Parallel
    samples (``n > 1``) of one seeded request need distinct seeds from the caller, or they
    draw the same tokens.
    """

    params: SamplingParams
    prompt_ids: np.ndarray  # int32; the repetition penalty covers prompt tokens too
    output_ids: np.ndarray  # int32; tokens generated so far; len() is the seeded step index


@dataclass
class SampleOutput:
    """Per-row results; logprobs are log-softmax of the raw logits (before penalties)."""

    token_ids: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B], at the chosen token
    top_ids: np.ndarray | None  # int32 [B, N], N = max requested over the batch; None if none asked
    top_logprobs: np.ndarray | None  # float32 [B, N]


def _to_host(parts: list[torch.Tensor]) -> np.ndarray:
    """The step's one device-to-host copy, and so its one sync: int32 parts, flattened, joined."""
    return torch.cat([part.reshape(-1) for part in parts]).cpu().numpy()


def _token_counts(ids_by_row: dict[int, np.ndarray], shape: tuple[int, int],
                  device: torch.device) -> torch.Tensor:
    """[B, V] float32 counts of each token in the given rows' ids (zero for other rows)."""
    counts = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)
    if ids_by_row:
        lengths = [len(ids) for ids in ids_by_row.values()]
        rows = np.repeat(np.fromiter(ids_by_row, dtype=np.int64), lengths)
        ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in ids_by_row.values()])
        rows_t, ids_t = to_device(np.stack([rows, ids]), device)
        counts.scatter_add_(0, rows_t * shape[1] + ids_t,
                            torch.ones_like(ids_t, dtype=torch.float32))
    return counts.view(shape)


def apply_penalties(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """Return float32 logits with each row's repetition, frequency and presence penalties.

    - repetition (HF/CTRL): for tokens seen in the prompt or the output, positive logits are
      divided by the penalty and negative ones multiplied by it;
    - frequency: subtract ``penalty * count`` of the token in the output;
    - presence: subtract ``penalty`` if the token occurs in the output at all.
    """
    logits = logits.float()
    device, shape = logits.device, tuple(logits.shape)
    repetition = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    additive = [i for i, r in enumerate(rows)
                if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if not repetition and not additive:
        return logits
    output_rows = sorted(set(repetition) | set(additive))
    output_counts = _token_counts({i: rows[i].output_ids for i in output_rows}, shape, device)
    penalties = to_device(np.array([[r.params.repetition_penalty for r in rows],
                                    [r.params.frequency_penalty for r in rows],
                                    [r.params.presence_penalty for r in rows]], dtype=np.float32),
                          device)
    logits = logits.clone()
    if repetition:
        prompt_counts = _token_counts({i: rows[i].prompt_ids for i in repetition}, shape, device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        penalty = penalties[0].unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if additive:
        frequency, presence = penalties[1], penalties[2]
        logits -= frequency.unsqueeze(1) * output_counts
        logits -= presence.unsqueeze(1) * (output_counts > 0).float()
    return logits


def apply_filters(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> torch.Tensor:
    """Set every token outside a row's top-k / top-p / min-p set to -inf.

    ``logits`` [B, V] (already temperature-scaled); per-row ``top_k`` (<= 0: off), ``top_p``
    (1: off) and ``min_p`` (0: off), each a host array of shape [B] (host, so that how many
    candidates to rank is known without reading the device). Applied in that order:

    - top-k keeps the k highest logits;
    - top-p keeps the smallest prefix of the remaining tokens, by descending probability,
      whose probability mass reaches ``top_p`` (a token is kept while the mass *before* it is
      below ``top_p``, so the most likely token always survives);
    - min-p drops tokens whose probability is below ``min_p`` times the highest probability.
      That ratio does not change when the survivors are renormalised, so it is taken over the
      top-k set.
    """
    vocab_size = logits.shape[-1]
    top_k = np.asarray(top_k, dtype=np.int64)
    k = np.where(top_k > 0, np.minimum(top_k, vocab_size), vocab_size)
    # Nothing past the largest k can survive: when every row sets top-k, rank only that many
    # candidates instead of sorting the whole vocabulary.
    num_candidates = int(k.max())
    if num_candidates < vocab_size:
        sorted_logits, order = logits.topk(num_candidates, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    # float64 holds every k exactly, and each p as the float32 it is compared as.
    params = to_device(np.stack([k, top_p, min_p]).astype(np.float64), logits.device)
    k, top_p, min_p = params[0].long(), params[1].float(), params[2].float()
    positions = torch.arange(num_candidates, device=logits.device)
    drop = positions.unsqueeze(0) >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = torch.cumsum(probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(mass_before[:, :1]), mass_before[:, :-1]], dim=-1)
    top_p = top_p.to(probs.dtype).unsqueeze(1)
    # Rows at top_p == 1 skip the test: rounding can push the running sum to 1 before the tail.
    drop |= (mass_before >= top_p) & (top_p < 1.0)
    drop |= probs < min_p.to(probs.dtype).unsqueeze(1) * probs[:, :1]
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, filtered)


def _mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (seed, step): splitmix64 so nearby pairs are unrelated."""
    value = (seed * 0x9E3779B97F4A7C15 + step) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@functools.cache
def _seeded_generator(device: torch.device) -> torch.Generator:
    """The generator seeded rows re-seed, one per device, made once: creating a CUDA generator
    costs far more than ``manual_seed``, which only sets host-side state. Re-seeding it for the
    next row while the last row's draw is still queued is safe: a CUDA kernel takes its seed
    and offset by value at launch."""
    return torch.Generator(device=device)


def _exponential_noise(rows: list[RowState], vocab_size: int,
                       device: torch.device) -> torch.Tensor:
    """[len(rows), V] Exp(1) draws: per-(seed, step) generators for seeded rows, else global."""
    noise = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if len(unseeded) == len(rows):
        noise.exponential_()
    elif unseeded:
        # Same draws from the global generator as filling all rows would give these rows alone.
        draws = torch.empty(len(unseeded), vocab_size, device=device).exponential_()
        noise.index_copy_(0, to_device(np.array(unseeded, dtype=np.int64), device), draws)
    generator = _seeded_generator(device)
    for i, row in enumerate(rows):
        if row.params.seed is not None:
            generator.manual_seed(_mix_seed(row.params.seed, len(row.output_ids)))
            noise[i].exponential_(generator=generator)
    # Exp(1) can round to exactly 0, which would turn a filtered token's 0 / 0 into NaN.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _sample_random(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """Temperature, filters and an exponential race for non-greedy rows; returns ids [R]."""
    device = logits.device
    temperature = np.array([r.params.temperature for r in rows], dtype=np.float32)
    logits = logits / to_device(temperature, device).unsqueeze(1)
    # Decided on the host: the sort behind the filters is the costliest op here, skip it if unused.
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0 for r in rows):
        logits = apply_filters(logits, np.array([r.params.top_k for r in rows]),
                               np.array([r.params.top_p for r in rows]),
                               np.array([r.params.min_p for r in rows]))
    probs = logits.softmax(dim=-1)
    return (probs / _exponential_noise(rows, logits.shape[-1], device)).argmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[RowState],
           allowed: tuple[list[int], torch.Tensor] | None = None) -> SampleOutput:
    """Pick one token per row of ``logits`` [B, V] following each row's ``SamplingParams``;
    ``allowed`` (row numbers, [len(rows), V] bool): the only tokens those rows may take.

    The returned arrays are views of one host buffer: the step's single device-to-host copy.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
    if allowed is not None:
        index = to_device(np.asarray(allowed[0], dtype=np.int64), logits.device)
        constrained = logits.index_select(0, index).masked_fill(~allowed[1], float("-inf"))
        logits = logits.index_copy(0, index, constrained)
    penalised = apply_penalties(logits, rows)

    token_ids = penalised.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        index = to_device(np.array(random_rows, dtype=np.int64), logits.device)
        sampled = _sample_random(penalised.index_select(0, index), [rows[i] for i in random_rows])
        token_ids.index_copy_(0, index, sampled)

    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    # One int32 buffer for every result; float32 values travel as their bits, exactly.
    parts = [token_ids.to(torch.int32), chosen.view(torch.int32)]
    requested = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    top_n = min(max(requested), logits.shape[-1]) if requested else 0
    if requested:
        values, indices = raw_logprobs.topk(top_n, dim=-1)
        parts += [indices.to(torch.int32), values.view(torch.int32)]
    num_rows = len(rows)
    ends = np.cumsum([num_rows, num_rows, num_rows * top_n])
    ids, chosen_bits, top_ids, top_bits = np.split(_to_host(parts), ends)
    return SampleOutput(
        token_ids=ids,
        logprobs=chosen_bits.view(np.float32),
        top_ids=top_ids.reshape(num_rows, top_n) if requested else None,
        top_logprobs=top_bits.view(np.float32).reshape(num_rows, top_n) if requested else None,
    )
