"""Sampler semantics on hand-made logits: filters, penalties, greedy, seeds, distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.contracts.sampling_params import SamplingParams
from engine.worker.sampler import RowState, _mix_seed, apply_filters, apply_penalties, sample


def row(
    output_ids: list[int] | None = None, prompt_ids: list[int] | None = None, **params
) -> RowState:
    return RowState(
        params=SamplingParams(**params),
        prompt_ids=np.asarray(prompt_ids or [], dtype=np.int32),
        output_ids=np.asarray(output_ids or [], dtype=np.int32),
    )


def survivors(
    logits: list[float], top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> list[int]:
    filtered = apply_filters(
        torch.tensor([logits]), np.array([top_k]), np.array([top_p]), np.array([min_p])
    )
    return torch.isfinite(filtered[0]).nonzero().flatten().tolist()


# probs 0.4, 0.3, 0.2, 0.1 in a scrambled order: token 2 > token 0 > token 3 > token 1
SCRAMBLED = [math.log(0.3), math.log(0.1), math.log(0.4), math.log(0.2)]


def test_top_k_keeps_the_k_highest() -> None:
    assert survivors(SCRAMBLED, top_k=1) == [2]
    assert survivors(SCRAMBLED, top_k=2) == [0, 2]
    assert survivors(SCRAMBLED, top_k=3) == [0, 2, 3]
    assert survivors(SCRAMBLED, top_k=10) == [0, 1, 2, 3]
    assert survivors(SCRAMBLED, top_k=-1) == [0, 1, 2, 3]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert survivors(SCRAMBLED, top_p=0.35) == [2]
    assert survivors(SCRAMBLED, top_p=0.65) == [0, 2]
    assert survivors(SCRAMBLED, top_p=0.75) == [0, 2, 3]
    assert survivors(SCRAMBLED, top_p=0.95) == [0, 1, 2, 3]
    # Always at least one token, however small p is.
    assert survivors(SCRAMBLED, top_p=1e-6) == [2]
    assert survivors(SCRAMBLED, top_p=1.0) == [0, 1, 2, 3]


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    assert survivors(SCRAMBLED, min_p=0.3) == [0, 2, 3]  # threshold 0.12 drops 0.1
    assert survivors(SCRAMBLED, min_p=0.6) == [0, 2]  # threshold 0.24 drops 0.2
    assert survivors(SCRAMBLED, min_p=0.9) == [2]


def test_filters_compose_in_order_top_k_then_top_p_then_min_p() -> None:
    # Alone, 0.4 + 0.3 falls short of 0.72 and a third token is needed; after top-k 3 the
    # survivors renormalise to 4/9, 3/9, 2/9 and two of them reach it.
    assert survivors(SCRAMBLED, top_p=0.72) == [0, 2, 3]
    assert survivors(SCRAMBLED, top_k=3, top_p=0.72) == [0, 2]
    assert survivors(SCRAMBLED, top_k=3, top_p=0.95, min_p=0.6) == [0, 2]


def test_filters_are_per_row() -> None:
    logits = torch.tensor([SCRAMBLED, SCRAMBLED, SCRAMBLED])
    filtered = apply_filters(
        logits, np.array([1, -1, -1]), np.array([1.0, 0.65, 1.0]), np.array([0.0, 0.0, 0.6])
    )
    kept = torch.isfinite(filtered)
    assert kept.tolist() == [
        [False, False, True, False],
        [True, False, True, False],
        [True, False, True, False],
    ]
    # Survivors keep their logit unchanged.
    assert torch.equal(filtered[kept], logits[kept])


def test_partial_ranking_matches_full_sort() -> None:
    # A row alone with top-k ranks only k candidates; batched with a top-k-free row, the whole
    # vocabulary is sorted. Both must keep the same tokens.
    torch.manual_seed(2)
    logits = torch.randn(6, 500) * 2
    top_k = np.array([1, 5, 40, 200, 499, 500])
    top_p = np.array([1.0, 0.5, 0.9, 0.99, 0.3, 0.8])
    min_p = np.array([0.0, 0.1, 0.0, 0.05, 0.0, 0.02])
    for i in range(6):
        alone = apply_filters(
            logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1]
        )
        batch = apply_filters(
            logits[[i, 0]], np.array([top_k[i], -1]), top_p[[i, 0]], min_p[[i, 0]]
        )
        assert torch.equal(torch.isfinite(alone[0]), torch.isfinite(batch[0]))
        assert torch.isfinite(alone[0]).sum() >= 1


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt, output = [0, 1], [3, 3, 4]

    rep = apply_penalties(logits, [row(output, prompt, repetition_penalty=2.0)])
    assert rep.tolist() == [[1.0, -2.0, 0.5, 1.5, -4.0, 1.0]]

    freq = apply_penalties(logits, [row(output, prompt, frequency_penalty=0.5)])
    assert freq.tolist() == [[2.0, -1.0, 0.5, 2.0, -2.5, 1.0]]  # prompt tokens are not counted

    pres = apply_penalties(logits, [row(output, prompt, presence_penalty=0.25)])
    assert pres.tolist() == [[2.0, -1.0, 0.5, 2.75, -2.25, 1.0]]

    both = apply_penalties(
        logits,
        [row(output, prompt, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)],
    )
    assert both.tolist() == [[1.0, -2.0, 0.5, 0.25, -4.75, 1.0]]


def test_penalties_are_per_row_and_leave_input_alone() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    rows = [
        row([0], [1], repetition_penalty=2.0),
        row([0], [1]),  # no penalties: untouched although it has ids
        row([2, 2], [], frequency_penalty=1.0),
    ]
    penalised = apply_penalties(logits, rows)
    assert penalised.tolist() == [[1.0, -2.0, 0.5], [2.0, -1.0, 0.5], [2.0, -1.0, -1.5]]
    assert logits.tolist() == [[2.0, -1.0, 0.5]] * 3


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    rows = [
        row(temperature=0.0),
        row(top_k=1),
        row(temperature=0.0, seed=7),
        row(),
        row(logprobs=5),
    ]
    out = sample(logits, rows)
    expected = logits.argmax(dim=-1).numpy()
    assert out.token_ids.dtype == np.int32 and out.token_ids.shape == (5,)
    assert (out.token_ids[:3] == expected[:3]).all()
    reference = torch.log_softmax(logits, dim=-1)
    chosen = reference.gather(1, torch.from_numpy(out.token_ids).long().unsqueeze(1)).squeeze(1)
    np.testing.assert_allclose(out.logprobs, chosen.numpy(), rtol=0, atol=1e-6)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (5, 5) and out.top_ids.dtype == np.int32
    top = reference.topk(5, dim=-1)
    assert (out.top_ids == top.indices.numpy()).all()
    np.testing.assert_allclose(out.top_logprobs, top.values.numpy(), rtol=0, atol=1e-6)


def test_logprobs_come_from_raw_logits_not_penalised_ones() -> None:
    logits = torch.tensor([[3.0, 1.5, 0.0]])
    out = sample(logits, [row([0], temperature=0.0, presence_penalty=2.0, logprobs=2)])
    assert out.token_ids.tolist() == [1]  # 3 - 2 < 1.5 after the penalty
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.logprobs[0] == pytest.approx(float(raw[1]), abs=1e-6)
    assert out.top_ids is not None and out.top_ids.tolist() == [[0, 1]]


def test_no_logprobs_requested_gives_none_and_large_top_n_works() -> None:
    logits = torch.randn(2, 300)
    assert sample(logits, [row(), row()]).top_ids is None
    out = sample(logits, [row(logprobs=0), row(logprobs=64)])
    assert out.top_ids is not None and out.top_ids.shape == (2, 64)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 200)
    target = row([5, 6, 7], seed=1234, temperature=1.3, top_p=0.95)
    alone = sample(logits[2:3], [target]).token_ids[0]
    # Same row at another batch position, next to greedy, unseeded and other seeded rows.
    mixed = sample(
        logits[[0, 1, 2, 3]],
        [row(temperature=0.0), row(seed=99), target, row()],
    ).token_ids[2]
    assert alone == mixed
    # Draws over many steps: the same (seed, step) always gives the same token.
    first = [sample(logits[:1], [row([0] * step, seed=5)]).token_ids[0] for step in range(30)]
    again = [sample(logits[:1], [row([1] * step, seed=5)]).token_ids[0] for step in range(30)]
    assert first == again
    assert len(set(first)) > 5  # the step index moves the draw


def reference_draw(logits: torch.Tensor, rows: list[RowState]) -> list[int]:
    """The draw written plainly, without filters or penalties: unseeded rows' uniforms in one
    block from the global generator, a fresh generator for each seeded row, and each row's
    token the first whose running probability (float64, token order) exceeds its uniform."""
    uniforms = torch.empty(len(rows), dtype=torch.float64)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(_mix_seed(r.params.seed, len(r.output_ids)))
            uniforms[i] = torch.rand(1, dtype=torch.float64, generator=generator)[0]
    temperature = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
    weights = (logits / temperature).softmax(dim=-1).double()
    running = weights.cumsum(dim=-1) / weights.sum(dim=-1, keepdim=True)
    return [int((row < u).sum()) for row, u in zip(running, uniforms, strict=True)]


def test_reused_generators_draw_what_fresh_ones_did() -> None:
    # Batches of every composition over many steps: how many seeded rows came before a row, and
    # whether unseeded rows share its batch, must not change its token, which must be the one a
    # fresh generator per row gave.
    rng = np.random.default_rng(0)
    logits = torch.zeros(1, 64)  # plus noise below: each row its own distribution
    drawn: set[tuple[int, int]] = set()
    for step in range(40):
        rows = []
        for _ in range(int(rng.integers(1, 9))):
            seeded = rng.random() < 0.7
            rows.append(
                row(
                    [0] * int(rng.integers(0, 6)),
                    seed=int(rng.integers(0, 4)) if seeded else None,
                    temperature=float(rng.choice([0.5, 1.0, 1.7])),
                )
            )
        batch_logits = logits.expand(len(rows), -1) + torch.randn(len(rows), 64)
        torch.manual_seed(step)
        got = sample(batch_logits, rows).token_ids.tolist()
        torch.manual_seed(step)
        assert got == reference_draw(batch_logits, rows)
        for r, token, row_logits in zip(rows, got, batch_logits, strict=True):
            if r.params.seed is not None:
                single = sample(row_logits.unsqueeze(0), [r]).token_ids[0]
                assert token == single
                drawn.add((r.params.seed, len(r.output_ids)))
    assert len(drawn) > 10  # many (seed, step) pairs were drawn, in many batch positions


def test_sample_returns_host_arrays_with_fixed_dtypes_and_shapes() -> None:
    logits = torch.randn(3, 40)
    out = sample(logits, [row(seed=1, logprobs=4), row(temperature=0.0), row(top_k=3)])
    for array, dtype, shape in [
        (out.token_ids, np.int32, (3,)),
        (out.logprobs, np.float32, (3,)),
        (out.top_ids, np.int32, (3, 4)),
        (out.top_logprobs, np.float32, (3, 4)),
    ]:
        assert isinstance(array, np.ndarray) and array.dtype == dtype and array.shape == shape
    # Logprobs that are -inf (a masked token) survive the trip as bits.
    logits[:, 5] = float("-inf")
    out = sample(logits[:2], [row(logprobs=40), row(logprobs=0)])
    assert out.top_logprobs is not None and np.isneginf(out.top_logprobs[:, -1]).all()
    assert (out.top_ids[:, -1] == 5).all()
    out = sample(logits[:1], [row(logprobs=0)])
    assert out.top_ids is not None and out.top_ids.shape == (1, 0)
    assert out.top_logprobs is not None and out.top_logprobs.shape == (1, 0)


def test_a_step_reads_the_device_once(monkeypatch) -> None:
    """On CUDA each read of a device value waits for the queued work; on the CPU the same calls
    are spied on. One ``.cpu()`` per step, and nothing else reads a tensor's value."""
    reads: list[str] = []
    for name in ("cpu", "item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, name=name, original=original, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    logits = torch.randn(6, 80)
    rows = [
        row(temperature=0.0, logprobs=2),
        row([1, 2], [3], seed=4, repetition_penalty=1.2, top_k=5),
        row([7], frequency_penalty=0.5, presence_penalty=0.1, top_p=0.9),
        row(min_p=0.1, logprobs=5),
        row(seed=9, temperature=0.6),
        row(),
    ]
    sample(logits, rows)
    assert reads == ["cpu"]


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)  # uniform: each draw is a fresh token
    tokens = {int(sample(logits, [row(seed=seed)]).token_ids[0]) for seed in range(50)}
    assert len(tokens) > 40


def test_greedy_rows_do_not_consume_random_draws() -> None:
    logits = torch.randn(2, 100)
    torch.manual_seed(3)
    with_greedy = sample(logits, [row(temperature=0.0), row()]).token_ids[1]
    torch.manual_seed(3)
    without = sample(logits[1:], [row()]).token_ids[0]
    assert with_greedy == without


@pytest.mark.parametrize(("seeded", "temperature"), [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_empirical_distribution_matches_softmax(seeded: bool, temperature: float) -> None:
    logits = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5]).log()
    draws = 4000
    torch.manual_seed(11)
    if seeded:
        rows = [row(seed=seed, temperature=temperature) for seed in range(draws)]
    else:
        rows = [row(temperature=temperature) for _ in range(draws)]
    tokens = sample(logits.expand(draws, -1).contiguous(), rows).token_ids
    observed = np.bincount(tokens, minlength=5)
    expected = (logits / temperature).softmax(dim=-1).numpy() * draws
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 20.0  # 4 degrees of freedom: p < 0.001 is about 18.5


def test_temperature_sharpens_and_filters_restrict_sampling() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(2000, -1).contiguous()
    cold = sample(logits, [row(seed=s, temperature=0.1) for s in range(2000)]).token_ids
    assert (cold == 3).mean() > 0.99
    top2 = sample(logits, [row(seed=s, top_k=2) for s in range(2000)]).token_ids
    assert set(top2.tolist()) == {2, 3}
    minp = sample(logits, [row(seed=s, min_p=0.3) for s in range(2000)]).token_ids
    assert set(minp.tolist()) == {2, 3}  # e^-2 ≈ 0.14 < 0.3 of the max


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(2, 5), [row()])
