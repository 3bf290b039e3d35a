"""scripts/check_cuda_graphs.py's comparison of graph and eager logits, on made-up tensors: a
rounding-sized difference passes, a flipped top-1 fails only away from a near-tie, and a wrong
row (a stale graph output) fails."""

from __future__ import annotations

import torch

from scripts.check_cuda_graphs import LOGIT_TOLERANCE, compare_logits


def logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_rounding_sized_differences_pass() -> None:
    reference = logits()
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
    result = compare_logits(reference, reference + 1e-3 * noise)
    assert result.ok and result.rows == 6
    assert result.max_abs_diff <= LOGIT_TOLERANCE * result.spread
    assert compare_logits(reference, reference.clone()).max_abs_diff == 0


def clear_leaders(rows: int = 6, vocab: int = 50) -> torch.Tensor:
    """Rows of small noise with token ``row`` leading by 3."""
    out = 0.1 * logits(rows, vocab)
    out[torch.arange(rows), torch.arange(rows)] = 3.0
    return out


def test_a_top1_flip_counts_only_away_from_a_near_tie() -> None:
    reference = clear_leaders()
    reference[0, 7] = 3.0 - 1e-4  # row 0: a near-tie between tokens 0 and 7
    flipped = reference.clone()
    flipped[0, 7] += 2e-4  # within tolerance, and now 7 leads
    result = compare_logits(reference, flipped)
    assert (result.decisive_rows, result.top1_agree) == (5, 5) and result.ok

    # Away from a tie no difference within the tolerance can flip top-1: one that does fails.
    wrong = reference.clone()
    wrong[1, 9] = 3.0 + 1e-3  # row 1 led clearly; now 9 does
    result = compare_logits(reference, wrong)
    assert (result.decisive_rows, result.top1_agree) == (5, 4) and not result.ok


def test_a_stale_output_fails() -> None:
    """A graph's output overwritten by a later replay (another step's logits) is far off."""
    assert not compare_logits(logits(seed=0), logits(seed=2)).ok
    assert compare_logits(logits(seed=0).bfloat16(), logits(seed=0)).ok
