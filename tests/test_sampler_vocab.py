"""The sampler's vocabulary-sized work done the cheap way gives what the plain way gave: partial
ranking for top-p / min-p against a whole-vocabulary sort, the draw over candidates against the
draw over the whole vocabulary, sparse penalties against dense counts, the grammar bitmask
unpacked on the host against its bit definition, greedy ties."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

import engine.worker.sampler as sampler
from engine.contracts.sampling_params import SamplingParams
from engine.worker.grammar import Grammars, Masks
from engine.worker.sampler import RowState, apply_filters, apply_penalties, sample
from tests.test_sampler import reference_draw


def row(output_ids=(), prompt_ids=(), **params) -> RowState:
    return RowState(SamplingParams(**params), np.asarray(prompt_ids, dtype=np.int32),
                    np.asarray(output_ids, dtype=np.int32))


def full_sort_filters(monkeypatch, *args) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "_PARTIAL_RANKS", ())
        return apply_filters(*args)


@pytest.mark.parametrize("spread", [4.0, 0.3, 0.01])  # peaked, flat (past 1,024), nearly uniform
def test_partial_ranking_keeps_what_a_full_sort_keeps(monkeypatch, spread: float) -> None:
    torch.manual_seed(0)
    vocab = 40_000
    logits = torch.randn(5, vocab) * spread
    top_k = np.array([-1, -1, -1, 50, 20_000])  # the last is past both partial sizes
    top_p = np.array([0.9, 1.0, 0.5, 0.95, 0.8])
    min_p = np.array([0.0, 0.05, 0.1, 0.0, 0.0])
    expected = full_sort_filters(monkeypatch, logits, top_k, top_p, min_p)
    assert torch.equal(apply_filters(logits, top_k, top_p, min_p), expected)
    # Without the top-k row past the partial sizes, the other rows rank partially.
    widths = []
    ranked = sampler._filter_ranked
    monkeypatch.setattr(sampler, "_filter_ranked",
                        lambda logits, values, *rest: widths.append(values.shape[-1])
                        or ranked(logits, values, *rest))
    got = apply_filters(logits[:4], top_k[:4], top_p[:4], min_p[:4])
    monkeypatch.undo()
    if spread == 4.0:
        assert widths == [1024]  # peaked rows: their survivors lie in the first candidates
    want = full_sort_filters(monkeypatch, logits[:4], top_k[:4], top_p[:4], min_p[:4])
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits[:4][torch.isfinite(want)])


def test_a_filtered_draw_is_the_draw_over_the_whole_vocabulary() -> None:
    torch.manual_seed(3)
    vocab = 5_000
    logits = torch.randn(6, vocab) * 2
    options = [dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=7, top_p=0.5),
               dict(top_p=0.99, min_p=0.01), dict()]
    for step in range(20):
        rows = [row([0] * step, seed=100 + i, temperature=0.7, **o) for i, o in enumerate(options)]
        got = sample(logits, rows).token_ids.tolist()
        scaled = logits / 0.7
        filtered = apply_filters(scaled, np.array([r.params.top_k for r in rows]),
                                 np.array([r.params.top_p for r in rows]),
                                 np.array([r.params.min_p for r in rows]))
        # reference_draw divides by each row's temperature: hand it the filtered logits at 1.
        plain = [row([0] * step, seed=100 + i, temperature=1.0) for i in range(len(rows))]
        assert got == reference_draw(filtered, plain)
        for i, r in enumerate(rows):  # and alone: the same token
            assert sample(logits[i : i + 1], [r]).token_ids[0] == got[i]


def dense_penalties(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """The penalties over [B, V] counts, as the sampler first computed them."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        counts = torch.bincount(torch.as_tensor(r.output_ids, dtype=torch.long),
                                minlength=logits.shape[1]).float()
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            seen |= torch.bincount(torch.as_tensor(r.prompt_ids, dtype=torch.long),
                                   minlength=logits.shape[1]) > 0
            penalised = torch.where(out[i] > 0, out[i] / p.repetition_penalty,
                                    out[i] * p.repetition_penalty)
            out[i] = torch.where(seen, penalised, out[i])
        out[i] -= p.frequency_penalty * counts
        out[i] -= p.presence_penalty * (counts > 0).float()
    return out


def test_sparse_penalties_equal_dense_counts() -> None:
    rng = np.random.default_rng(0)
    vocab = 3_000
    logits = torch.randn(5, vocab) * 3
    ids = lambda n: rng.integers(0, 200, n)  # noqa: E731 - a small range: repeats and overlaps
    rows = [row(ids(50), ids(80), repetition_penalty=1.3),
            row(ids(40), ids(10), frequency_penalty=0.7, presence_penalty=-0.4),
            row(ids(30), ids(30), repetition_penalty=0.8, frequency_penalty=-1.5,
                presence_penalty=2.0),
            row(ids(20), ids(20)),
            row([], ids(25), repetition_penalty=1.1, presence_penalty=0.5)]
    assert torch.equal(apply_penalties(logits, rows), dense_penalties(logits, rows))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(logits, [row([vocab], [], presence_penalty=0.5)] + rows[1:])


def test_greedy_takes_the_first_of_equal_maxima() -> None:
    logits = torch.zeros(2, 70_000)
    logits[0, [9, 40_000, 69_999]] = 5.0
    logits[1, [69_998, 12]] = 1.0
    assert sample(logits, [row(temperature=0.0), row(top_k=1)]).token_ids.tolist() == [9, 12]


def test_bitmask_unpacks_to_the_tokens_its_bits_name() -> None:
    rng = np.random.default_rng(1)
    vocab = 1_000  # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = rng.integers(-2**31, 2**31, (3, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    bitmask[2] = 0  # nothing allowed: the first end token is
    done: Future = Future()
    done.set_result(None)
    allowed = Grammars("unused", vocab, [7, 8]).allowed(Masks([0, 1, 2], bitmask, done),
                                                        torch.device("cpu"), vocab)
    tokens = np.arange(vocab)
    expected = (bitmask[:, tokens // 32].astype(np.int64) >> (tokens % 32)) & 1
    expected[2, 7] = 1
    assert allowed.dtype == torch.bool and allowed.shape == (3, vocab)
    assert (allowed.numpy() == expected.astype(bool)).all()
    # Applied to every row of a batch, or to some: the same tokens.
    logits = torch.randn(3, vocab)
    greedy = [row(temperature=0.0)] * 3
    masked = logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    assert sample(logits, greedy, ([0, 1, 2], allowed)).token_ids.tolist() == masked
    some = sample(logits, greedy, ([0, 2], allowed[[0, 2]])).token_ids.tolist()
    assert some == [masked[0], int(logits[1].argmax()), masked[2]]
