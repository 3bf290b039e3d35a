"""Beam search bookkeeping (transformers' semantics): per step, the best ``2 W`` continuations
over all beams by cumulative logprob; an end-of-sequence candidate ranked within the first
``W`` becomes a finished hypothesis scored ``sum_logprobs / generated_len ** length_penalty``;
the first ``W`` other candidates become the next beams."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Candidate:
    parent: int  # index into the beams of this step
    token: int
    cum_logprob: float


def select(cum_logprobs: list[float], top_ids: np.ndarray, top_logprobs: np.ndarray,
           width: int, eos_ids: set[int]) -> tuple[list[Candidate], list[Candidate]]:
    """Returns (next beams, finished candidates ending in EOS) for one step."""
    scores = np.asarray(cum_logprobs, dtype=np.float64)[:, None] + top_logprobs
    flat = scores.ravel()
    order = np.argsort(-flat, kind="stable")[: 2 * width]
    n_cols = top_ids.shape[1]
    beams: list[Candidate] = []
    finished: list[Candidate] = []
    for rank, flat_index in enumerate(order):
        parent, col = divmod(int(flat_index), n_cols)
        cand = Candidate(parent, int(top_ids[parent, col]), float(flat[flat_index]))
        if cand.token in eos_ids:
            if rank < width:
                finished.append(cand)
        else:
            beams.append(cand)
        if len(beams) == width:
            break
    return beams, finished


def score(cum_logprob: float, generated_len: int, length_penalty: float) -> float:
    try:
        return cum_logprob / (max(generated_len, 1) ** length_penalty)
    except (OverflowError, ZeroDivisionError):
        # Requests validate |length_penalty| <= 10, but a score must never raise mid-step:
        # past float64's range the quotient is at its limit (the length term won outright).
        return 0.0 if length_penalty > 0 or cum_logprob == 0 else -math.inf


def is_done(finished_scores: list[float], best_running: float, generated_len: int,
            width: int, length_penalty: float) -> bool:
    """No running beam can still beat the worst of ``width`` finished hypotheses."""
    if len(finished_scores) < width:
        return False
    worst = sorted(finished_scores, reverse=True)[width - 1]
    return worst >= score(best_running, generated_len, length_penalty)
