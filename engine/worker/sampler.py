"""Token sampling on the logits' device, vectorised over the batch.

Pipeline for one step::

    raw logits ──▶ logprobs / top-N logprobs (reported from the *raw* logits)
        │
        ├─ constrained rows: tokens their grammar forbids to -inf (engine/worker/grammar.py)
        ├─ penalties: repetition (prompt + output), frequency, presence
        ├─ greedy rows (temperature 0 or top_k 1): argmax, no random draw at all
        └─ random rows: / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ one uniform draw

Sampling inverts each row's distribution function in token-id order with one uniform ``u``
(``_sample_random``), which picks token i with probability ``probs[i]``. A seeded row draws
``u`` from a generator seeded only by ``(seed, len(output_ids))``, so its token depends on
nothing but its seed, its step and its logits: the same seed gives the same text whatever else
is in the batch and however often the request was preempted and resumed. Unseeded rows draw
from torch's default generator for the device (``torch.manual_seed`` makes them reproducible
in tests).

Per-request Python work builds the small parameter tensors; everything per token is torch ops.
At a 262,144-token vocabulary each pass over a row's logits counts (docs/benchmarks.md, "A
262,144-token vocabulary"), so nothing here sorts the whole vocabulary on the CPU unless the
filters need it, draws noise for every token, or builds [B, V] counts for the penalties.

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


def _penalty_entries(rows: list[RowState], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, token) entries the penalties touch, as flat indices into [B, V], and per entry
    [repetition penalty, count in the output, frequency penalty, presence penalty] (float32
    [4, N]): for each penalised row, the tokens of its output, and of its prompt too when its
    repetition penalty is on. Built on the host from the rows' ids: no [B, V] count tensor."""
    index, values = [], []
    for i, row in enumerate(rows):
        p = row.params
        repetition = p.repetition_penalty != 1.0
        if not repetition and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            continue
        output_ids, output_counts = np.unique(np.asarray(row.output_ids, dtype=np.int64),
                                              return_counts=True)
        ids = (np.union1d(output_ids, np.asarray(row.prompt_ids, dtype=np.int64))
               if repetition else output_ids)
        if len(ids) and (ids[0] < 0 or ids[-1] >= vocab_size):
            raise ValueError(f"a penalised row holds token id {int(ids[0] if ids[0] < 0 else ids[-1])}"
                             f", outside the vocabulary of {vocab_size:,}")
        counts = np.zeros(len(ids), dtype=np.float32)
        counts[np.searchsorted(ids, output_ids)] = output_counts
        index.append(i * vocab_size + ids)
        values.append(np.stack([np.full(len(ids), p.repetition_penalty, dtype=np.float32),
                                counts, np.full(len(ids), p.frequency_penalty, dtype=np.float32),
                                np.full(len(ids), p.presence_penalty, dtype=np.float32)]))
    if not index:
        return np.zeros(0, dtype=np.int64), np.zeros((4, 0), dtype=np.float32)
    return np.concatenate(index), np.concatenate(values, axis=1)


def apply_penalties(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """Return float32 logits with each row's repetition, frequency and presence penalties.

    - repetition (HF/CTRL): for tokens seen in the prompt or the output, positive logits are
      divided by the penalty and negative ones multiplied by it;
    - frequency: subtract ``penalty * count`` of the token in the output;
    - presence: subtract ``penalty`` if the token occurs in the output at all.

    Only the logits of tokens a row has seen change, so only those are read and written (a
    gather and a scatter of that many entries, whatever the vocabulary's size).
    """
    logits = logits.float()
    index, values = _penalty_entries(rows, logits.shape[-1])
    if not len(index):
        return logits
    index_t = to_device(index, logits.device)
    repetition, counts, frequency, presence = to_device(values, logits.device)
    logits = logits.contiguous().clone()
    flat = logits.view(-1)
    seen = flat.index_select(0, index_t)
    seen = torch.where(seen > 0, seen / repetition, seen * repetition)
    seen -= frequency * counts
    seen -= presence * (counts > 0).float()
    flat.index_copy_(0, index_t, seen)
    return logits


# On the CPU, a row without top-k that filters by top-p or min-p ranks this many candidates
# first (then the next size), and sorts its whole vocabulary only when they do not hold every
# survivor: a 262,144-token row sorts in about 15 ms, its top 1,024 come in about 0.5 ms.
_PARTIAL_RANKS = (1024, 16384)


def apply_filters(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> torch.Tensor:
    """Set every token outside a row's top-k / top-p / min-p set to -inf
    (``filter_candidates`` says how)."""
    values, ids = filter_candidates(logits, top_k, top_p, min_p)
    return torch.full_like(logits, float("-inf")).scatter_(-1, ids, values)


def filter_candidates(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray,
                      min_p: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates that hold every token of a row's top-k / top-p / min-p set: their
    logits, -inf where filtered out, and token ids, both [B, C] (descending; C <= V).

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

    Nothing past the largest k can survive: when every row sets top-k, only that many
    candidates are ranked. On the CPU, rows that all filter but some without top-k rank the
    ``_PARTIAL_RANKS`` candidates first, their probabilities taken over the whole vocabulary,
    and keep that answer when every row's last candidate is dropped (each filter drops a
    suffix of the ranking, so no later token survives either): reading that flag is free on
    the CPU, where a whole-vocabulary sort is not. On other devices the sort is cheap and a
    read would wait for the queue, so they sort.
    """
    vocab_size = logits.shape[-1]
    top_k = np.asarray(top_k, dtype=np.int64)
    k = np.where(top_k > 0, np.minimum(top_k, vocab_size), vocab_size)
    top_p, min_p = np.asarray(top_p), np.asarray(min_p)
    num_candidates = int(k.max())
    if num_candidates < vocab_size:
        return _filter_ranked(logits, *logits.topk(num_candidates, dim=-1), k, top_p, min_p)[:2]
    filtering = (k < vocab_size) | (top_p < 1.0) | (min_p > 0.0)
    if logits.device.type == "cpu" and filtering.all():
        log_norm = None
        for size in _PARTIAL_RANKS:
            if size >= vocab_size or ((k > size) & (k < vocab_size)).any():
                break  # a top-k row past these candidates needs its own k of them
            if log_norm is None:
                log_norm = logits.logsumexp(dim=-1)
            filtered, ids, dropped = _filter_ranked(logits, *logits.topk(size, dim=-1), k,
                                                    top_p, min_p, log_norm)
            if bool(dropped[:, -1].all()):
                return filtered, ids
    return _filter_ranked(logits, *logits.sort(dim=-1, descending=True), k, top_p, min_p)[:2]


def _filter_ranked(logits: torch.Tensor, ranked: torch.Tensor, order: torch.Tensor,
                   k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                   log_norm: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``filter_candidates`` over the leading candidates ``ranked`` (descending) at ``order``:
    their filtered logits, ``order``, and which were dropped. ``log_norm``: each row's
    log-sum-exp over the whole vocabulary, the normaliser of rows without top-k when the
    candidates are not all the vocabulary."""
    vocab_size, num_candidates = logits.shape[-1], ranked.shape[-1]
    # float64 holds every k exactly, and each p as the float32 it is compared as.
    params = to_device(np.stack([k, top_p, min_p]).astype(np.float64), logits.device)
    k_t, top_p_t, min_p_t = params[0].long(), params[1].float(), params[2].float()
    positions = torch.arange(num_candidates, device=logits.device)
    drop = positions.unsqueeze(0) >= k_t.unsqueeze(1)
    probs = ranked.masked_fill(drop, float("-inf")).softmax(dim=-1)
    if log_norm is not None:
        whole = (ranked - log_norm.unsqueeze(1)).exp()
        probs = torch.where((k_t >= vocab_size).unsqueeze(1), whole, probs)
    mass_before = torch.cumsum(probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(mass_before[:, :1]), mass_before[:, :-1]], dim=-1)
    top_p_t = top_p_t.to(probs.dtype).unsqueeze(1)
    # Rows at top_p == 1 skip the test: rounding can push the running sum to 1 before the tail.
    drop |= (mass_before >= top_p_t) & (top_p_t < 1.0)
    drop |= probs < min_p_t.to(probs.dtype).unsqueeze(1) * probs[:, :1]
    return ranked.masked_fill(drop, float("-inf")), order, drop


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


def _uniforms(rows: list[RowState], device: torch.device) -> torch.Tensor:
    """[len(rows)] float64 U[0, 1) draws: per-(seed, step) generators for seeded rows, the
    global generator (one block) for the others."""
    draws = torch.empty(len(rows), dtype=torch.float64, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        # Same draws from the global generator as these rows alone would take.
        draws.index_copy_(0, to_device(np.array(unseeded, dtype=np.int64), device),
                          torch.rand(len(unseeded), dtype=torch.float64, device=device))
    generator = _seeded_generator(device)
    for i, row in enumerate(rows):
        if row.params.seed is not None:
            generator.manual_seed(_mix_seed(row.params.seed, len(row.output_ids)))
            draws[i : i + 1].uniform_(generator=generator)
    return draws


def _sample_random(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """Temperature, filters and one draw from each row's distribution; returns ids [R].

    The draw inverts the row's distribution function in token-id order: with weights
    ``w = exp(logit - max)`` (0 for filtered tokens) summed in float64, token i is the first
    whose running sum exceeds ``u * total``, so it is picked with probability ``w[i] / total``.
    Rows that filter draw over their candidates put back in token-id order, which skips only
    zero weights: the same token as over the whole vocabulary. One uniform a row, where an
    exponential race over the vocabulary drew 4.6 ms a row at 262,144 tokens on the CPU; the
    order is the vocabulary's, so a seeded row's token depends on its seed, step and logits
    alone, never on the rows beside it (nor on how many candidates the batch ranked).
    """
    device = logits.device
    temperature = to_device(np.array([r.params.temperature for r in rows], dtype=np.float32),
                            device)
    uniforms = _uniforms(rows, device)
    filtering = [i for i, r in enumerate(rows)
                 if r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0.0]
    if not filtering:
        return _draw(logits, uniforms, temperature)
    picked = [rows[i].params for i in filtering]
    index = to_device(np.array(filtering, dtype=np.int64), device)
    values, ids = filter_candidates(logits.index_select(0, index) / temperature[index, None],
                                    np.array([p.top_k for p in picked]),
                                    np.array([p.top_p for p in picked]),
                                    np.array([p.min_p for p in picked]))
    if ids.shape[-1] == logits.shape[-1]:  # the whole vocabulary was ranked: scatter it back
        chosen = _draw(torch.full_like(values, float("-inf")).scatter_(-1, ids, values),
                       uniforms[index])
    else:
        ids, order = ids.sort(dim=-1)
        chosen = ids.gather(1, _draw(values.gather(1, order), uniforms[index]).unsqueeze(1))
        chosen = chosen.squeeze(1)
    if len(filtering) == len(rows):
        return chosen
    others = to_device(np.setdiff1d(np.arange(len(rows)), filtering), device)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
    tokens.index_copy_(0, index, chosen)
    return tokens.index_copy_(0, others, _draw(logits.index_select(0, others),
                                               uniforms[others], temperature[others]))


def _draw(logits: torch.Tensor, uniforms: torch.Tensor,
          temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the first column whose running weight (float64) exceeds ``uniforms`` times
    the row's total weight; weights ``exp((logit - max) / temperature)``."""
    weights = logits - logits.amax(dim=-1, keepdim=True)
    if temperature is not None:
        weights.div_(temperature.unsqueeze(1))
    weights.exp_()
    running = weights.cumsum(dim=-1, dtype=torch.float64)
    total = running[:, -1:]
    # Below the total, so that the pick is a column of nonzero weight however u rounds.
    target = torch.minimum(uniforms.unsqueeze(1) * total,
                           total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(running, target, right=True).squeeze(1)


def sample(logits: torch.Tensor, rows: list[RowState],
           allowed: tuple[list[int], torch.Tensor] | None = None) -> SampleOutput:
    """Pick one token per row of ``logits`` [B, V] following each row's ``SamplingParams``;
    ``allowed`` (row numbers, [len(rows), V] bool): the only tokens those rows may take.

    The returned arrays are views of one host buffer: the step's single device-to-host copy.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
    if allowed is not None and list(allowed[0]) == list(range(len(rows))):  # every row
        logits = logits.masked_fill(allowed[1].logical_not(), float("-inf"))
    elif allowed is not None:
        index = to_device(np.asarray(allowed[0], dtype=np.int64), logits.device)
        constrained = logits.index_select(0, index).masked_fill(~allowed[1], float("-inf"))
        logits = logits.index_copy(0, index, constrained)
    penalised = apply_penalties(logits, rows)

    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) == len(rows):  # no greedy row: no argmax, no copy of the rows
        token_ids = _sample_random(penalised, rows)
    else:
        token_ids = penalised.max(dim=-1).indices  # the first maximum, as argmax (2x as fast)
    if random_rows and len(random_rows) < len(rows):
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
