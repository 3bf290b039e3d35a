"""Speculative decoding with a draft model (engine/worker/draft.py, scheduler/draft_model.py):
two small written models of one tokenizer, driven in-process with the accounting check after
every step (the harness of tests/test_scheduler.py). Outputs are compared with decoding
without drafts; the draft's KV shares the target's pages.

Drafts: a draft that IS the target (the same weights) proposes what the target then picks
(greedy), so verification accepts whole drafts and the draft's catch-up runs; a draft of other
weights is mostly rejected, so rollbacks run; one of the target's weights with noise added
between the two."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import SchedulerStats
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.speculative import SpeculativeConfig
from engine.server.metrics import FrontendState, Metrics
from engine.worker.draft import check_same_vocabulary
from scheduler.draft_model import DraftModelPolicy
from scheduler.speculation import Speculator
from tests.conftest_models import load_reference, noisy_copy, write_checkpoint
from tests.test_scheduler import Harness
from tests.tokenizer_fixtures import byte_level_tokenizer, metaspace_tokenizer

VOCAB = 128


def _model(path, seed: int, tokenizer=None, **overrides) -> str:
    write_checkpoint(path, "llama", seed=seed, head_std=0.6,
                     **{"vocab_size": VOCAB, "max_position_embeddings": 512, **overrides})
    (tokenizer or byte_level_tokenizer()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """target; same (its copy); other (other weights, one layer); near (the target's weights
    with noise: mostly accepted, sometimes not); foreign (another tokenizer)."""
    root = tmp_path_factory.mktemp("draft_models")
    target = _model(root / "target", seed=0)
    same = str(root / "same")
    shutil.copytree(target, same)
    near = noisy_copy(target, root / "near", 0.12, seed=3)
    return {"target": target, "same": same, "near": near,
            "other": _model(root / "other", seed=1, num_hidden_layers=1),
            "foreign": _model(root / "foreign", seed=1, tokenizer=metaspace_tokenizer())}


@pytest.fixture(autouse=True)
def untimed_steps(monkeypatch):
    """The steps' times are not fed to the drafting rules (their priors decide; the draft
    model is on at every batch size), so which drafts run does not hang on how loaded the
    machine is; the rules' use of measured times is tested on given ones
    (tests/test_draft_model_off.py)."""
    monkeypatch.setattr(Speculator, "step_took", lambda self, entries, seconds: None)
    monkeypatch.setattr(DraftModelPolicy, "drafting", lambda self, num_running: True)


def spec(model: str, k: int = 4, **extra) -> str:
    return json.dumps({"model": model, "num_speculative_tokens": k, **extra})


def workload(seed: int = 0, count: int = 5, max_tokens: int = 30) -> dict:
    rng = np.random.default_rng(seed)
    return {f"r{i}": (rng.integers(3, VOCAB, int(rng.integers(5, 40))).tolist(),
                      SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.0,
                                     ignore_eos=True))
            for i in range(count)}


def run(model_dir: str, requests: dict, **options) -> Harness:
    h = Harness(model_dir, **options)
    if h.worker.draft is not None:
        h.draft_reads = watch_draft_reads(h)
    for rid, (prompt, params) in requests.items():
        h.add(rid, prompt, params)
    h.run()
    return h


@pytest.mark.parametrize("draft", ["same", "near", "other"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_outputs_are_those_without_a_draft(models, draft, page_size):
    requests = workload(seed=page_size)
    base = run(models["target"], requests, page_size=page_size, num_pages=400)
    h = run(models["target"], requests, page_size=page_size, num_pages=400,
            speculative_config=spec(models[draft]))
    assert h.outputs == base.outputs
    s = h.sched.speculator
    assert s.model.drafted_tokens > 0
    if draft == "same":
        assert s.model.accepted_tokens == s.model.drafted_tokens
    if draft == "other":
        assert s.model.accepted_tokens < s.model.drafted_tokens


def test_drafts_that_stop_early_leave_no_verify_rows(models, monkeypatch):
    """Four drafts asked each step, made only while the draft is 95% sure: the verify rows
    of drafts never made are dropped from the model's step; greedy and seeded outputs are
    those without a draft."""
    monkeypatch.setattr(DraftModelPolicy, "drafts_for",
                        lambda self, seq, room, num_running: min(4, room))
    requests = workload(seed=4, count=3)
    requests.update({f"s{i}": (np.random.default_rng(20 + i).integers(3, VOCAB, 9).tolist(),
                               SamplingParams(max_tokens=20, temperature=0.8, seed=i,
                                              ignore_eos=True)) for i in range(2)})
    base = run(models["target"], requests, page_size=4, num_pages=300)
    h = run(models["target"], requests, page_size=4, num_pages=300,
            speculative_config=spec(models["near"], draft_min_token_prob=0.95))
    assert h.outputs == base.outputs
    assert h.worker.draft.rows_trimmed > 0
    model = h.sched.speculator.model
    assert 0 < model.accepted_tokens < model.drafted_tokens


def test_the_option_takes_a_model_and_refuses_what_it_cannot_run_with(models):
    config = SpeculativeConfig.parse(spec(models["same"], k=3))
    assert (config.method, config.model, config.draft_min_token_prob) == (
        "draft_model", models["same"], 0.4)
    assert config.suffix_decoding_max_tree_depth == 24  # the cache's drafts come first
    with pytest.raises(ValueError, match="--tp-size above 1"):  # tiers: tests/test_draft_tiers.py
        EngineConfig(model=models["target"], speculative_config=spec(models["same"]),
                     tp_size=2).validate()
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig.parse(json.dumps({"method": "ngram", "model": "x",
                                            "num_speculative_tokens": 2}))


def test_a_draft_of_another_tokenizer_or_vocabulary_is_refused(models, tmp_path):
    check_same_vocabulary(models["target"], models["same"])
    with pytest.raises(ValueError, match="tokenizer is not the model's"):
        check_same_vocabulary(models["target"], models["foreign"])
    wider = _model(tmp_path / "wider", seed=2, vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match=f"{VOCAB + 8} token ids but the model has {VOCAB}"):
        check_same_vocabulary(models["target"], wider)
    with pytest.raises(ValueError, match="tokenizer is not the model's"):
        Harness(models["target"], speculative_config=spec(models["foreign"]))


def _assert_draft_kv_is_the_targets(h: Harness, least: int = 10) -> None:
    """With a draft of the target's weights, every slot the draft's record calls computed
    holds the same KV in both pools (up to rounding: the draft computed it in other steps'
    shapes), and at least ``least`` of the slots the tree caches are such."""
    target, draft = h.worker.runner.pool.kv, h.worker.draft.runner.pool.kv
    record = h.worker.draft.slots
    size = h.sched.info.page_size
    slots = np.flatnonzero(record.ok).tolist()
    flat = [kv.flatten(2, 3)[:, :, slots] for kv in (target, draft)]
    torch.testing.assert_close(flat[1], flat[0], atol=2e-4, rtol=1e-3)
    cached = []
    for node in h.sched.tree.iter_nodes():
        if node.on_device:
            positions = np.arange(node.start, node.end)
            pages = np.asarray(node.pages)[positions // size - node.start // size]
            cached += (pages * size + positions % size).tolist()
    assert record.ok[cached].sum() >= least


def watch_draft_reads(h: Harness) -> list[int]:
    """Check, before every forward of the draft, that each of its sequences reads only slots
    whose draft KV is computed (the record says so, or an earlier forward of the same step
    wrote it); returns a count of the slots read, growing."""
    draft = h.worker.draft
    forward, propose = draft.runner.forward, draft.propose
    written: set[int] = set()
    read = [0]

    def checked_forward(batch):
        for j in range(batch.num_seqs):
            pages = batch.page_indices[batch.page_indptr[j] : batch.page_indptr[j + 1]]
            slots = draft.slots.slots(pages, 0, int(batch.seq_lens[j] - batch.extend_lens[j]))
            fresh = np.isin(slots, np.fromiter(written, np.int64, len(written)))
            assert (draft.slots.ok[slots] | fresh).all(), "the draft read KV it never computed"
            read[0] += len(slots)
        written.update(np.asarray(batch.out_slots).tolist())
        return forward(batch)

    def checked_propose(step, guide=None):
        written.clear()
        return propose(step, guide)

    draft.runner.forward, draft.propose = checked_forward, checked_propose
    return read


def test_the_drafts_kv_sits_in_the_targets_pages_and_prefix_hits_serve_both(models,
                                                                            monkeypatch):
    """The first request's prompt and outputs cached; the second shares its prompt's head: a
    prefix hit for the target is one for the draft (its drafts, from cached KV, are all
    accepted; the draft model's taken over the cache's, whatever the steps' times). The
    draft's pool holds the target's KV in every slot it computed."""
    monkeypatch.setattr(Speculator, "_cache_rate", lambda self, seq, count, n: 0.0)
    rng = np.random.default_rng(7)
    head = rng.integers(3, VOCAB, 40).tolist()
    first = {"a": (head + [5, 6], SamplingParams(max_tokens=30, temperature=0.0,
                                                 ignore_eos=True))}
    second = {"b": (head + [9], SamplingParams(max_tokens=30, temperature=0.0,
                                               ignore_eos=True))}
    base = run(models["target"], {**first}, page_size=4, num_pages=200)
    for rid, (prompt, params) in second.items():
        base.add(rid, prompt, params)
    base.run()
    h = run(models["target"], first, page_size=4, num_pages=200,
            speculative_config=spec(models["same"]))
    _assert_draft_kv_is_the_targets(h)
    model = h.sched.speculator.model
    drafted = model.drafted_tokens
    hits = h.sched.tree.stats.hit_tokens
    for rid, (prompt, params) in second.items():
        h.add(rid, prompt, params)
    h.run()
    assert h.sched.tree.stats.hit_tokens - hits >= 40
    assert model.drafted_tokens > drafted
    assert model.accepted_tokens == model.drafted_tokens
    assert h.outputs == base.outputs
    _assert_draft_kv_is_the_targets(h)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_rollbacks_and_preemption_leak_no_page(models, mode):
    """Rejected drafts (a draft of other weights) roll back both models' KV: after every step
    no sequence holds pages past its tokens and the accounting check passes; a pool too small
    for the batch preempts, and outputs stay those without drafts."""
    requests = workload(seed=9, count=6, max_tokens=40)
    options = dict(page_size=2, num_pages=90, preemption_mode=mode,
                   num_host_pages=200 if mode == "swap" else 0)
    base = run(models["target"], requests, **options)
    for draft in ("other", "near"):
        h = Harness(models["target"], speculative_config=spec(models[draft], k=5), **options)
        watch_draft_reads(h)
        for rid, (prompt, params) in requests.items():
            h.add(rid, prompt, params)
        while not h.sched.idle:
            h.step()  # the accounting check after every step
            for req in [] if h.sched.inflight else h.sched.running:
                for seq in req.live_seqs():
                    assert len(seq.pages) <= h.sched.alloc.pages_for(len(seq.tokens))
        h.assert_idle_clean()
        assert h.outputs == base.outputs
        assert h.sched.num_preemptions > 0
        model = h.sched.speculator.model
        assert 0 <= model.accepted_tokens < model.drafted_tokens


def test_seeded_samples_are_those_without_a_draft(models):
    requests = {f"s{i}": (np.random.default_rng(i).integers(3, VOCAB, 12).tolist(),
                          SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95,
                                         seed=100 + i, ignore_eos=True)) for i in range(4)}
    base = run(models["target"], requests, page_size=4, num_pages=200)
    h = run(models["target"], requests, page_size=4, num_pages=200,
            speculative_config=spec(models["near"]))
    assert h.outputs == base.outputs
    assert h.sched.speculator.model.accepted_tokens > 0


@pytest.mark.parametrize("vocab", [0, 48])
def test_rejection_sampling_keeps_the_targets_distribution(models, monkeypatch, vocab):
    """Unseeded samples at temperature 1, the third token often from a verify row after an
    accepted draft and otherwise from the next step: its distribution, given the most frequent
    first two, is the target's (transformers' float32 model); chi-square at 99.9%. Every
    sequence drafts (2000 in a step would not pay). With the draft's whole vocabulary and with
    its first 48 ids (and those it read: ``draft_vocab_size``)."""
    monkeypatch.setattr(DraftModelPolicy, "drafts_for",
                        lambda self, seq, room, num_running: min(2, room))
    prompt = np.random.default_rng(11).integers(3, VOCAB, 10).tolist()
    torch.manual_seed(0)
    h = Harness(models["target"], page_size=4, num_pages=6000,
                speculative_config=spec(models["near"], k=2, disable_by_batch_size=4096,
                                        draft_vocab_size=vocab))
    count = 2000
    for i in range(count):
        h.add(f"q{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    h.run()
    model = h.sched.speculator.model
    assert 0.2 * model.drafted_tokens < model.accepted_tokens < model.drafted_tokens
    outs = np.array([h.outputs[f"q{i}"][0] for i in range(count)])
    pairs, counts = np.unique(outs[:, :2], axis=0, return_counts=True)
    t1, t2 = pairs[counts.argmax()]
    third = outs[(outs[:, 0] == t1) & (outs[:, 1] == t2), 2]
    assert len(third) > 200
    reference = load_reference(models["target"])
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + [int(t1), int(t2)]])).logits[0, -1]
    p = torch.softmax(logits.double(), -1).numpy()
    assert_drawn_from(np.bincount(third, minlength=len(p)), p)


def assert_drawn_from(seen: np.ndarray, p: np.ndarray) -> None:
    """``seen`` (how often each token was drawn) is a sample of the distribution ``p``:
    chi-square at 99.9%, the tokens expected fewer than 5 times pooled into one bin."""
    expected = seen.sum() * p
    big = expected >= 5
    observed = np.append(seen[big], seen[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    chi2 = ((observed - wanted) ** 2 / np.maximum(wanted, 1e-9)).sum()
    df = len(observed) - 1  # its 99.9% quantile by Wilson and Hilferty's approximation
    assert chi2 < df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3


def test_deferred_draft_kv_is_computed_before_anything_reads_it(models, monkeypatch):
    """Steps the draft model sits out (every other one here) and verifies of the cache's
    drafts (a prompt sent again: the suffix method drafts the first reply, taken wherever it
    has a continuation) leave the draft's
    KV missing; a drafting sequence computes what it lacks before any draft forward reads it
    (checked before every forward), so the pools agree (a draft of the target's weights) and
    every draft is accepted, the second reply's too."""
    drafts_for = DraftModelPolicy.drafts_for
    calls = [0]

    def every_other(self, seq, room, num_running):
        calls[0] += 1
        return drafts_for(self, seq, room, num_running) if calls[0] % 2 else 0

    monkeypatch.setattr(DraftModelPolicy, "drafts_for", every_other)
    requests = workload(seed=3, count=3, max_tokens=30)
    base = run(models["target"], requests, page_size=4, num_pages=300)
    h = run(models["target"], requests, page_size=4, num_pages=300,
            speculative_config=spec(models["same"]))
    _assert_draft_kv_is_the_targets(h)
    s = h.sched.speculator
    before = s.drafted_tokens - s.model.drafted_tokens
    monkeypatch.setattr(DraftModelPolicy, "rate", lambda self, seq, n: 0.0)  # the cache's first
    prompt, params = requests["r0"]
    h.add("again", prompt, params)
    base.add("again", prompt, params)
    h.run()
    base.run()
    assert h.outputs == base.outputs
    assert s.drafted_tokens - s.model.drafted_tokens > before  # the cache's drafts
    assert s.model.accepted_tokens == s.model.drafted_tokens
    _assert_draft_kv_is_the_targets(h)


def test_sequences_not_drafting_cost_the_draft_nothing_and_drafting_resumes(models,
                                                                           monkeypatch):
    """While no sequence drafts, the draft runs no forward (its KV of prompts and outputs is
    not computed). Once drafting resumes, a sequence whose prefix the tree matched catches
    the draft up over the cached tokens it lacks (in forwards of at most ``CATCH_UP_CHUNK``
    tokens: 7 here) before its first draft, and its drafts (the target's weights) are all
    accepted; outputs are those without a draft."""
    from engine.worker import draft as draft_module

    monkeypatch.setattr(draft_module, "CATCH_UP_CHUNK", 7)
    monkeypatch.setattr(Speculator, "_cache_rate", lambda self, seq, count, n: 0.0)
    drafts_for = DraftModelPolicy.drafts_for
    enabled = [False]
    monkeypatch.setattr(DraftModelPolicy, "drafts_for", lambda self, seq, room, n: (
        drafts_for(self, seq, room, n) if enabled[0] else 0))
    requests = workload(seed=5, count=3, max_tokens=20)
    base = run(models["target"], requests, page_size=4, num_pages=300)
    h = run(models["target"], requests, page_size=4, num_pages=300,
            speculative_config=spec(models["same"]))
    draft = h.worker.draft
    assert draft.tokens_computed == 0 and not draft.slots.ok.any()
    enabled[0] = True
    prompt, params = requests["r1"]
    again = {"again": (prompt + h.outputs["r1"][0][:10], params)}
    for harness in (h, base):
        for rid, (ids, p) in again.items():
            harness.add(rid, ids, p)
        harness.run()
    assert h.outputs == base.outputs
    model = h.sched.speculator.model
    assert model.drafted_tokens > 0 and model.accepted_tokens == model.drafted_tokens
    assert draft.tokens_computed >= len(again["again"][0])
    assert h.draft_reads[0] > 0
    _assert_draft_kv_is_the_targets(h, least=len(again["again"][0]))


def test_metrics_show_the_draft_models_drafts_and_pauses():
    stats = SchedulerStats(spec_method="draft_model", spec_drafted_tokens=50,
                           spec_accepted_tokens=40, spec_model_drafted_tokens=30,
                           spec_model_accepted_tokens=24, spec_model_pauses=2,
                           spec_model_off_steps=7)
    text = Metrics(lambda: stats, lambda: FrontendState(0, 0, True)).render().decode()
    name = "radixserve_spec_decode_draft_model"
    assert f'{name}_num_draft_tokens_total{{method="draft_model"}} 30.0' in text
    assert f'{name}_num_accepted_tokens_total{{method="draft_model"}} 24.0' in text
    assert f'{name}_pauses_total{{method="draft_model"}} 2.0' in text
    assert f'{name}_off_steps_total{{method="draft_model"}} 7.0' in text
    assert 'radixserve_spec_decode_num_draft_tokens_total{method="draft_model"} 50.0' in text
