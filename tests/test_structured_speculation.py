"""Speculation for structured output (engine/worker/grammar_drafts.py): a constrained request's
drafts, from the cache (ngram, suffix) or from a draft model, are kept only while its grammar
allows them, each verify row is sampled under the grammar's state after the drafts before it,
and the grammar ends each step where the emitted tokens leave it. Driven in-process on the
demo model (the draft model: the demo model's weights, and those with noise added), the
accounting check after every step (tests/test_scheduler.py's harness)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.structured import StructuredOutputs
from engine.contracts.tokenizer import load_tokenizer
from engine.worker import grammar
from scheduler import speculation
from scheduler.draft_model import DraftModelPolicy
from tests.conftest_models import noisy_copy
from tests.test_draft_model import assert_drawn_from
from tests.test_scheduler import Harness
from tests.test_speculation import Oracle
from tests.test_structured_output import CHOICES, PERSON, PHONE

SPECS = {"person": StructuredOutputs(json=json.dumps(PERSON)),
         "object": StructuredOutputs(json_object=True),
         "phone": StructuredOutputs(regex=PHONE),
         "choice": StructuredOutputs(choice=CHOICES)}
TEXTS = ['Example: {"name":"Ann","age":30,"role":"admin","address":{"city":"Oslo","zip":12345}}',
         "Call 555-1234 or 555-1234, then 555-1234", "positive negative positive neutral"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """target: the demo model; same: its copy; near: its weights with noise (drafts mostly
    accepted, sometimes not)."""
    target = str(build_demo_model())
    root = tmp_path_factory.mktemp("structured_drafts")
    same = str(root / "same")
    shutil.copytree(target, same)
    return {"target": target, "same": same, "near": noisy_copy(target, root / "near", 0.3, seed=5)}


@pytest.fixture(autouse=True)
def untimed_steps(monkeypatch):
    """Which steps draft follows the rules' priors, not the machine's load (as in
    tests/test_speculation.py and tests/test_draft_model.py)."""
    monkeypatch.setattr(speculation.Speculator, "step_took", lambda self, entries, seconds: None)
    monkeypatch.setattr(DraftModelPolicy, "drafting", lambda self, num_running: True)


def requests(model: str, seeded: bool = True) -> dict[str, tuple[list[int], SamplingParams]]:
    """Each constraint on each prompt, greedy, and seeded at temperature 0.9."""
    tokenizer = load_tokenizer(model)
    out = {}
    for name, constraint in SPECS.items():
        for p, text in enumerate(TEXTS):
            prompt = tokenizer(text)["input_ids"]
            out[f"{name}-{p}"] = (prompt, SamplingParams(max_tokens=48, temperature=0.0,
                                                         structured_outputs=constraint))
            if seeded:
                out[f"{name}-{p}-seeded"] = (prompt, SamplingParams(
                    max_tokens=48, temperature=0.9, seed=p, structured_outputs=constraint))
    return out


def run(model: str, reqs: dict, **options) -> Harness:
    """Every request to its end, checking after every step (besides the harness's accounting
    check) that each constrained sequence's grammar state is the one its settled outputs give
    (rolled back past rejected drafts) and that no sequence holds pages past its tokens."""
    h = Harness(model, **{"page_size": 4, "num_pages": 1024, **options})
    for rid, (prompt, params) in reqs.items():
        h.add(rid, prompt, params)
    while not h.sched.idle:
        h.step()
        if not h.sched.inflight:
            assert_grammars_follow_outputs(h)
            for req in h.sched.running:
                for seq in req.live_seqs():
                    assert len(seq.pages) <= h.sched.alloc.pages_for(len(seq.tokens))
    h.assert_idle_clean()
    return h


def assert_grammars_follow_outputs(h: Harness) -> None:
    """A live constrained sequence's grammar state took exactly its outputs (its tokens past
    the prompt): the same count, and the same next-token mask as a fresh matcher fed them."""
    import llguidance
    import llguidance.numpy as llnp

    from engine.contracts.structured import grammar_text, parser_limits

    grammars = h.worker.grammars
    for req in h.sched.running:
        for seq in req.live_seqs():
            state = grammars.states.get(f"{req.rid}#{seq.index}")
            if state is None:
                continue
            outputs = seq.tokens[req.prompt_len :]
            assert state.consumed == len(outputs), (req.rid, state.consumed, len(outputs))
            fresh = llguidance.LLMatcher(grammars.tokenizer, grammar_text(
                req.params.structured_outputs), log_level=0, limits=parser_limits())
            assert fresh.consume_tokens(outputs)
            masks = llnp.allocate_token_bitmask(2, grammars.vocab_size)
            llnp.fill_next_token_bitmask(state.matcher, masks, 0)
            llnp.fill_next_token_bitmask(fresh, masks, 1)
            assert (masks[0] == masks[1]).all(), req.rid


def watch_cuts(monkeypatch) -> list[tuple[bool, int, int, bool]]:
    """Every constrained verification's drafts as the grammar cut them: (the draft model's,
    drafts, kept, whether the first draft cut is one the grammar allows)."""
    seen = []
    cut = grammar.cut_drafts

    def recording(verifies, step, unused):
        out = cut(verifies, step, unused)
        for v in verifies:
            rest = v.drafts[v.kept :]
            allowed = bool(rest) and v.walk.matcher.validate_tokens(rest[:1]) == 1
            seen.append((bool(len(step.draft_lens) and step.draft_lens[v.seq]), len(v.drafts),
                         v.kept, allowed))
        return out

    monkeypatch.setattr(grammar, "cut_drafts", recording)
    return seen


def cache_spec(method: str) -> str:
    extra = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {}
    return json.dumps({"method": method, "num_speculative_tokens": 4, **extra})


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_cache_drafts_give_the_outputs_of_decoding_without_drafts(models, method,
                                                                  monkeypatch):
    """Oracle drafts (the reference continuation, every third draft wrong, running on past
    its end into tokens no grammar takes), then the method's own drafts: greedy and seeded
    outputs token for token those without drafts, each grammar in step with its outputs
    after every step, drafts the grammar refuses cut, partial acceptances among them."""
    reqs = requests(models["target"])
    base = run(models["target"], reqs)
    tail = load_tokenizer(models["target"])(" junk } tail")["input_ids"]
    oracle = Oracle([reqs[rid][0] + out[0] + tail for rid, out in base.outputs.items()])
    monkeypatch.setattr(speculation, "propose_ngram", oracle)
    if method == "suffix":
        monkeypatch.setattr(speculation.SuffixProposer, "propose",
                            lambda self, tokens, namespace, k: oracle(tokens, 0, 0, k).tolist())
    cuts = watch_cuts(monkeypatch)
    drafted = run(models["target"], reqs, speculative_config=cache_spec(method))
    assert drafted.outputs == base.outputs
    s = drafted.sched.speculator
    assert 0 < s.accepted_tokens < s.drafted_tokens
    assert drafted.steps < base.steps
    assert any(kept < count and not allowed for _, count, kept, allowed in cuts)  # refused
    assert any(kept < count and allowed for _, count, kept, allowed in cuts)  # ends or forces
    monkeypatch.undo()
    monkeypatch.setattr(speculation.Speculator, "step_took", lambda self, entries, seconds: None)
    looked_up = run(models["target"], reqs, speculative_config=cache_spec(method))
    assert looked_up.outputs == base.outputs


@pytest.mark.parametrize("draft", ["same", "near"])
@pytest.mark.parametrize("vocab", [0, 64])
def test_draft_model_drafts_only_what_the_grammar_allows(models, monkeypatch, draft, vocab):
    """Every constrained sequence asks the draft model for 3 drafts a step: each draft it
    proposes is one its grammar allows there (with its whole vocabulary; with the first 64 ids
    and those it read, a first draft that none of them the grammar allows is cut unverified),
    greedy and seeded outputs are those without drafts, and the grammars stay in step with
    the outputs."""
    monkeypatch.setattr(DraftModelPolicy, "drafts_for",
                        lambda self, seq, room, num_running: min(3, room))
    monkeypatch.setattr(speculation.Speculator, "_cache_rate", lambda self, seq, n, r: 0.0)
    reqs = requests(models["target"])
    base = run(models["target"], reqs)
    cuts = watch_cuts(monkeypatch)
    h = run(models["target"], reqs, speculative_config=json.dumps(
        {"model": models[draft], "num_speculative_tokens": 3, "draft_vocab_size": vocab,
         "draft_min_token_prob": 0.0}))
    assert h.outputs == base.outputs
    model = h.sched.speculator.model
    assert model.accepted_tokens > 0
    by_model = [c for c in cuts if c[0]]
    assert by_model
    if not vocab:
        assert all(allowed for _, count, kept, allowed in by_model if kept < count)
    if draft == "near":
        assert model.accepted_tokens < model.drafted_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_constrained_drafts_keeps_outputs_and_leaks_nothing(models,
                                                                            monkeypatch, mode):
    """A pool too small for the batch (admitted by a deliberately optimistic estimate)
    preempts sequences between verifications of the noisy draft's drafts (rejections among
    them): outputs are those without drafts, each grammar in step with its outputs and no page
    held past a sequence's tokens after every step, every pool free at the end (``run``'s
    checks)."""
    import scheduler.planner

    monkeypatch.setattr(scheduler.planner, "NEW_TOKEN_RATIO", (0.05, 0.05, 0.0))
    monkeypatch.setattr(DraftModelPolicy, "drafts_for",
                        lambda self, seq, room, num_running: min(3, room))
    monkeypatch.setattr(speculation.Speculator, "_cache_rate", lambda self, seq, n, r: 0.0)
    reqs = requests(models["target"], seeded=False)
    options = dict(num_pages=40, preemption_mode=mode,
                   num_host_pages=64 if mode == "swap" else 0)
    base = run(models["target"], reqs)
    h = run(models["target"], reqs, speculative_config=json.dumps(
        {"model": models["near"], "num_speculative_tokens": 3}), **options)
    assert h.outputs == base.outputs
    assert h.sched.num_preemptions > 0
    model = h.sched.speculator.model
    assert 0 < model.accepted_tokens < model.drafted_tokens


def test_rejection_sampling_keeps_the_targets_masked_distribution(models, monkeypatch):
    """Unseeded samples at temperature 1 under a regex, the third token mostly the one after
    the draft model's accepted draft in a verify step (sampled under the grammar's state after
    that draft; the draft is the target's weights, its draft the masked argmax) and otherwise
    from the next step: its distribution, given the most frequent first two, is the target's
    (transformers' float32 model) restricted to what the grammar allows there and
    renormalised; chi-square at 99.9%."""
    import llguidance
    import llguidance.numpy as llnp

    from engine.contracts.structured import grammar_text, parser_limits
    from tests.conftest_models import load_reference

    monkeypatch.setattr(DraftModelPolicy, "drafts_for",
                        lambda self, seq, room, num_running: min(2, room))
    constraint = StructuredOutputs(regex="([a-z][0-9]){1,8}")  # what follows a token varies
    prompt = load_tokenizer(models["target"])("the words are")["input_ids"]
    torch.manual_seed(0)
    h = Harness(models["target"], page_size=4, num_pages=3000, speculative_config=json.dumps(
        {"model": models["same"], "num_speculative_tokens": 2, "disable_by_batch_size": 4096}))
    count = 1500
    for i in range(count):
        h.add(f"q{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0,
                                              structured_outputs=constraint))
    h.run()
    model = h.sched.speculator.model
    assert 0.5 * model.drafted_tokens < model.accepted_tokens < model.drafted_tokens
    outs = [h.outputs[f"q{i}"][0] for i in range(count)]
    pairs, counts = np.unique([o[:2] for o in outs if len(o) == 3], axis=0, return_counts=True)
    t1, t2 = (int(t) for t in pairs[counts.argmax()])
    third = np.array([o[2] for o in outs if len(o) == 3 and o[:2] == [t1, t2]])
    assert len(third) > 150
    grammars = h.worker.grammars
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammar_text(constraint), log_level=0,
                                   limits=parser_limits())
    assert matcher.consume_tokens([t1, t2])
    bitmask = llnp.allocate_token_bitmask(1, grammars.vocab_size)
    llnp.fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = grammars.unpack(bitmask, torch.device("cpu"), grammars.vocab_size)[0]
    with torch.no_grad():
        logits = load_reference(models["target"])(torch.tensor([prompt + [t1, t2]])).logits[0, -1]
    p = torch.softmax(logits.double().masked_fill(~allowed, float("-inf")), -1).numpy()
    seen = np.bincount(third, minlength=len(p))
    assert seen[~allowed.numpy()].sum() == 0
    assert_drawn_from(seen, p)


def test_a_draft_head_in_blocks_drafts_under_the_grammar(default_model, monkeypatch):
    """The default model's GGUF (its LM head in Q4_1 blocks) drafting for itself from its
    first 160 ids and those it read (the head's logits: those columns only): each draft's
    grammar mask is taken at those columns, and greedy constrained outputs are those without
    a draft."""
    from engine.checkpoints.model_source import resolve_model

    monkeypatch.setattr(DraftModelPolicy, "drafts_for",
                        lambda self, seq, room, num_running: min(3, room))
    monkeypatch.setattr(speculation.Speculator, "_cache_rate", lambda self, seq, n, r: 0.0)
    model = resolve_model(default_model).path
    reqs = requests(model, seeded=False)
    options = dict(quantization="auto")
    base = run(model, reqs, **options)
    h = run(model, reqs, **options, speculative_config=json.dumps(
        {"model": model, "num_speculative_tokens": 3, "draft_vocab_size": 160}))
    assert h.worker.draft.vocab.fast
    assert h.outputs == base.outputs
    assert h.sched.speculator.model.accepted_tokens > 0
