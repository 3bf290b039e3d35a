"""A draft model's vocabulary (``draft_vocab_size``, engine/worker/draft_vocab.py): its drafts
come from the first ids and the ids of the text it read, never from outside; outputs are the
target's with it as without it, for a dense head (the subset's columns of every logit) and one
in blocks (the first rows read by the kernel, the extra ones beside). The rejection-sampling
distribution test runs with one too (tests/test_draft_model.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.contracts.speculative import SpeculativeConfig
from engine.worker.draft import DraftModel, draft_vocab_size
from engine.worker.draft_vocab import MAX_EXTRA, DraftVocab
from tests.test_draft_model import (  # noqa: F401 (fixtures)
    models,
    run,
    spec,
    untimed_steps,
    workload,
)


@pytest.fixture
def picks(monkeypatch) -> list[tuple[list[int], set[int]]]:
    """Every pick of the draft (its tokens) with the subset it was made from."""
    seen: list[tuple[list[int], set[int]]] = []
    pick = DraftModel._pick

    def watched(self, logits, allowed=None):
        tokens, sure = pick(self, logits, allowed)
        seen.append((tokens, set(self.vocab.ids().tolist())))
        return tokens, sure

    monkeypatch.setattr(DraftModel, "_pick", watched)
    return seen


def check_picks(picks, size: int) -> None:
    assert picks
    outside = 0
    for tokens, subset in picks:
        assert set(range(size)) <= subset
        assert set(tokens) <= subset
        outside += sum(t >= size for t in tokens)
    assert outside > 0  # some drafts were ids the draft read, past the first ``size``


@pytest.mark.parametrize("draft", ["same", "near"])
def test_a_dense_heads_drafts_come_from_its_subset_and_outputs_do_not_change(
        models, draft, picks):  # noqa: F811
    requests = workload(seed=7)
    base = run(models["target"], requests, page_size=4, num_pages=400)
    h = run(models["target"], requests, page_size=4, num_pages=400,
            speculative_config=spec(models[draft], draft_vocab_size=48))
    assert h.outputs == base.outputs
    draft_model = h.worker.draft
    assert draft_model.vocab is not None and not draft_model.vocab.fast
    check_picks(picks, 48)
    s = h.sched.speculator.model
    assert 0 < s.accepted_tokens <= s.drafted_tokens


def test_a_head_in_blocks_reads_its_first_rows(default_model, picks):
    """The default model's GGUF (its LM head in Q4_1 blocks) drafting for itself: the draft's
    head is its first 160 rows in the block kernel and the extra ids' rows; greedy outputs are
    those without a draft; the subset's logits are the whole head's columns (the first ones
    bit for bit: a row's result is its own in the kernel; the extra ones the float product
    of their rows)."""
    from engine.checkpoints.model_source import resolve_model

    model = resolve_model(default_model).path
    rng = np.random.default_rng(5)
    requests = {f"r{i}": (rng.integers(3, 120, int(rng.integers(5, 30))).tolist(),
                          workload()["r0"][1]) for i in range(4)}
    options = dict(page_size=4, num_pages=300, quantization="auto")
    base = run(model, requests, **options)
    h = run(model, requests, **options, speculative_config=spec(model, draft_vocab_size=160))
    assert h.outputs == base.outputs
    vocab = h.worker.draft.vocab
    assert vocab.fast and h.sched.speculator.model.accepted_tokens > 0
    check_picks(picks, 160)
    assert len(vocab.extra) and (vocab.extra >= 160).all()
    x = torch.randn(3, vocab._full.cols, generator=torch.Generator().manual_seed(0))
    full, ours = vocab._full(x), vocab(x)
    assert ours.shape == (3, 160 + len(vocab.extra))
    assert torch.equal(ours[:, :160], full[:, :160])
    # the extra ones: the dequantized rows' float product, which the kernel's is within 3%
    # of for 4-bit weights (tests/test_quant.py)
    rows = vocab._full.rows_dense(torch.from_numpy(vocab.extra), torch.float32)
    torch.testing.assert_close(ours[:, 160:], x @ rows.T)
    extra = full[:, vocab.extra]
    assert ((ours[:, 160:] - extra).norm() / extra.norm()).item() < 0.03


def test_the_subset_keeps_the_latest_extra_ids_read():
    class Model:
        config = type("Config", (), {"hidden_size": 8})
        quantized: dict = {}

    vocab = DraftVocab(Model(), 10)
    vocab.read(np.array([3, 12, 11, 12, 40]))
    assert vocab.extra.tolist() == [11, 12, 40]
    vocab.read(np.arange(100, 100 + MAX_EXTRA))
    assert len(vocab.extra) == MAX_EXTRA and vocab.extra[-1] == 99 + MAX_EXTRA
    assert vocab.ids().tolist()[:10] == list(range(10))
    logits = torch.arange(100 + MAX_EXTRA, dtype=torch.float32).repeat(2, 1)
    assert torch.equal(vocab.columns(logits)[0], vocab.ids().float())


def test_bad_draft_vocabulary_sizes_are_refused_with_a_sentence(models):  # noqa: F811
    assert SpeculativeConfig.parse(spec(models["same"])).draft_vocab_size is None
    with pytest.raises(ValueError, match=r"int.* >= 0 - at `\$.draft_vocab_size`"):
        SpeculativeConfig.parse(spec(models["same"], draft_vocab_size=-1))
    with pytest.raises(ValueError, match=r"int.* - at `\$.draft_vocab_size`"):
        SpeculativeConfig.parse(spec(models["same"], draft_vocab_size="many"))
    with pytest.raises(ValueError, match="does not take draft_vocab_size"):
        SpeculativeConfig.parse(json.dumps({"method": "suffix", "num_speculative_tokens": 2,
                                            "draft_vocab_size": 100}))
    with pytest.raises(ValueError, match="exceeds the draft model's vocabulary of 128"):
        draft_vocab_size(129, 128)
    # not given: the default, or everything where the vocabulary is smaller; 0: everything
    assert (draft_vocab_size(None, 128), draft_vocab_size(0, 151936),
            draft_vocab_size(None, 151936), draft_vocab_size(128, 128)) == (0, 0, 32768, 0)
