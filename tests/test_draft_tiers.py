"""A draft model's KV through the prefix cache's host and disk tiers (engine/worker/draft_tiers.py),
on tests/test_draft_model.py's two small written models of one tokenizer, driven in-process
with the accounting check after every step.

The draft's pages travel with the target's: written down to the host tier on eviction (or
when cached, under write-through) and loaded back on a hit, written to disk blocks and read
back by a restarted server, with the draft's record of which slots hold its KV. A hit loaded
from either tier gives the draft the KV it had computed: a draft of the target's weights
holds the target's KV in every slot its record vouches for, computes none of the loaded
prefix again, and drafts (and has accepted) exactly what it does where the prefix stayed on
the device. Host pages and disk blocks grow by the draft's bytes, and the disk directory's
fingerprint names the draft, so blocks written with one draft (or none) never serve another.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.disk_blocks import fingerprint
from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from engine.worker.kv_pool import KVPool
from engine.worker.model.config import ModelConfig
from engine.worker.tier_io import identity
from scheduler.speculation import Speculator
from tests.conftest_models import load_reference
from tests.test_disk_tier import block_files, served
from tests.test_draft_model import (  # noqa: F401
    VOCAB,
    models,
    run,
    spec,
    untimed_steps,
)
from tests.test_scheduler import Harness

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def model_drafts_first(monkeypatch):
    """The draft model's drafts are taken over the cache's (a resent prompt's reply is in the
    suffix index), so every second wave drafts with the draft's KV the tiers brought back."""
    monkeypatch.setattr(Speculator, "_cache_rate", lambda self, seq, count, n: 0.0)


def page_bytes(*model_dirs: str, page_size: int) -> int:
    """One page's KV bytes in fp32 over ``model_dirs`` (the target's and the draft's)."""
    total = 0
    for model in model_dirs:
        mc = ModelConfig.from_dir(model)
        total += KVPool.bytes_per_page(num_layers=mc.num_layers, page_size=page_size,
                                       num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                       dtype=torch.float32)
    return total


def prompts(count: int, seed: int, length: int = 45) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, length + i % 3).tolist() for i in range(count)]


def draft_counts(h: Harness) -> tuple[int, int, int]:
    """The draft model's drafted and accepted tokens and the tokens its forwards computed
    (none without one)."""
    if h.worker.draft is None:
        return 0, 0, 0
    model = h.sched.speculator.model
    return model.drafted_tokens, model.accepted_tokens, h.worker.draft.tokens_computed


def watch_catch_up(h: Harness) -> list[int]:
    """How many cached positions' draft KV each drafting sequence lacks as a step starts (what
    the draft's first forward computes again), one entry per drafting sequence and step."""
    slots, lacking = h.worker.draft.slots, []
    first_missing = slots.first_missing

    def counted(pages, cached):
        start = first_missing(pages, cached)
        lacking.append(cached - start)
        return start

    slots.first_missing = counted
    return lacking


def two_waves(h: Harness, cold: list[list[int]]) -> list[int]:
    """``cold`` one at a time, then again (the first resent as two greedy samples: its loads
    run in the step, the others' beside the steps); what the draft lacked in the second wave
    (``watch_catch_up``)."""
    for i, p in enumerate(cold):
        h.add(f"a{i}", p, GREEDY)
        h.run()
    lacking = watch_catch_up(h) if h.worker.draft is not None else []
    for i, p in enumerate(cold):
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2 if i == 0
                                else 1)
        h.add(f"b{i}", p, params)
        h.run()
    return lacking


def assert_draft_kv_is_a_fresh_prefills(h: Harness, draft_dir: str, least: int) -> None:
    """Every slot of the tree's device nodes whose draft KV the draft's record vouches for
    holds the token the record names and the KV that transformers' float32 draft model computes
    for it in one prefill of its whole prefix (K after RoPE); at least ``least`` are such."""
    reference = load_reference(draft_dir)
    pool, record = h.worker.draft.runner.pool.kv, h.worker.draft.slots
    size, checked = h.sched.info.page_size, 0
    for node in h.sched.tree.iter_nodes():
        if not node.on_device:
            continue
        chain, up = [], node
        while up.parent is not None:
            chain.append(np.frombuffer(up.key, np.int32))
            up = up.parent
        tokens = np.concatenate(chain[::-1])
        positions = np.arange(node.start, node.end)
        pages = np.asarray(node.pages)[positions // size - node.start // size]
        slots = pages * size + positions % size
        ok = record.ok[slots]
        if not ok.any():
            continue
        assert (record.tokens[slots[ok]] == tokens[positions[ok]]).all()
        with torch.no_grad():
            cache = reference(torch.tensor([tokens.tolist()]), use_cache=True).past_key_values
        for layer, kv in enumerate(cache.layers):
            for which, want in enumerate((kv.keys, kv.values)):
                got = pool[layer, which].flatten(0, 1)[torch.from_numpy(slots[ok])]
                torch.testing.assert_close(got, want[0, :, positions[ok]].transpose(0, 1),
                                           atol=2e-4, rtol=1e-3)
        checked += int(ok.sum())
    assert checked >= least


@pytest.mark.parametrize(("page_size", "policy", "draft"), [
    (1, "write_back", "same"), (4, "write_back", "same"), (4, "write_through", "same"),
    (4, "write_through", "near"), (4, "write_back", "near")])
def test_the_drafts_kv_goes_to_the_host_tier_and_comes_back(models, page_size,  # noqa: F811
                                                           policy, draft):
    """Five prompts through a device pool that holds about two: each pushes the oldest to the
    host tier, the draft's KV and record with it (under write-through, the copy made when the
    prompt was cached gets the draft's KV once the sequence drafts). Resent, the evicted
    prompts hit the host tier, and the draft lacks no more of them than on a device pool that
    kept them all: it computes none of what was loaded. Outputs are those without a draft,
    and the draft's KV wherever its record vouches for it is a fresh prefill's."""
    cold = prompts(5, seed=page_size)
    host_pages = 2048 // page_size
    options = dict(page_size=page_size, chunked_prefill_size=24, max_prefill_tokens=64)
    tiered = dict(num_pages=160 // page_size, cache_write_policy=policy,
                  host_cache_gb=host_pages * page_bytes(models["target"], models[draft],
                                                        page_size=page_size) / 2**30)
    h = Harness(models["target"], speculative_config=spec(models[draft]), **options, **tiered)
    assert h.sched.tree.host.allocator.num_pages == host_pages  # the draft's bytes paid
    assert h.worker.draft.runner.pool.host.shape[2] == h.worker.runner.pool.host.shape[2]
    lacking = two_waves(h, cold)
    kept = Harness(models["target"], speculative_config=spec(models[draft]),
                   num_pages=4096 // page_size, **options)
    # what the draft lacks is what it lacks on the device: never the prompt's loaded KV
    # (45 tokens), only its steps before its first draft (the forks' first few)
    assert max(lacking) == max(two_waves(kept, cold)) < 10
    base = Harness(models["target"], **options, **tiered)
    two_waves(base, cold)
    assert h.outputs == kept.outputs == base.outputs
    finals = [h.finals[f"b{i}"][0] for i in range(len(cold))]
    assert all(f.cached_tokens == len(p) - 1 for f, p in zip(finals, cold, strict=True))
    assert sum(f.cached_tokens_host for f in finals) >= 3 * 40  # most prompts from the host
    stats = h.sched.stats()
    assert stats["host_pages_written"] > 0 and stats["host_pages_loaded"] > 0
    model = h.sched.speculator.model
    assert model.drafted_tokens > 0
    if draft == "same":
        assert model.accepted_tokens == model.drafted_tokens
    assert_draft_kv_is_a_fresh_prefills(h, models[draft], least=len(cold[-1]))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_beside_the_host_tier_with_a_draft(models, mode):  # noqa: F811
    """Waves of prompts through a pool so small that decoding preempts (swap's host pages come
    before the tier's, in both models' host tensors) and prompts come back from the host tier,
    with drafts mostly rejected (rollbacks): outputs are those without a draft, nothing leaks,
    and the draft's KV wherever its record vouches for it is a fresh prefill's."""
    page_size = 4
    options = dict(page_size=page_size, num_pages=48, preemption_mode=mode,
                   num_host_pages=64 if mode == "swap" else 0, chunked_prefill_size=24,
                   max_prefill_tokens=48,
                   host_cache_gb=256 * page_bytes(models["target"], models["near"],
                                                  page_size=page_size) / 2**30)
    wave = prompts(5, seed=21, length=30)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    runs = []
    for config in ({}, {"speculative_config": spec(models["near"], k=5)}):
        h = Harness(models["target"], **options, **config)
        for name in "ab":
            for i, p in enumerate(wave):
                h.add(f"{name}{i}", p, params)
            h.run()
        runs.append(h)
    base, h = runs
    assert h.outputs == base.outputs
    assert h.sched.num_preemptions > 0
    assert sum(h.finals[f"b{i}"][0].cached_tokens_host for i in range(5)) > 0
    model = h.sched.speculator.model
    assert 0 < model.accepted_tokens < model.drafted_tokens
    assert_draft_kv_is_a_fresh_prefills(h, models["near"], least=30)
    tree = h.sched.tree
    tree.reset()
    for alloc in (tree.allocator, tree.host.allocator):
        assert alloc.num_free_pages == alloc.num_pages
    assert len(h.sched.mem.host_free) == options["num_host_pages"]


@pytest.mark.parametrize(("page_size", "draft"), [(1, "same"), (4, "same"), (4, "near")])
def test_a_restart_reads_the_drafts_kv_from_disk(models, tmp_path, page_size, draft):  # noqa: F811
    """A prompt served and written to disk, then served by a second scheduler and worker on
    the same directory (a restart): its blocks come back with the draft's KV and record, so
    the draft computes none of them again and drafts, has accepted and computes what it does
    on a second request that hit the device. The same greedy output, and the draft's KV
    wherever its record vouches for it is a fresh prefill's."""
    prompt = np.random.default_rng(page_size).integers(3, VOCAB, 100).tolist()
    options = dict(page_size=page_size, num_pages=200 // page_size,
                   speculative_config=spec(models[draft]), chunked_prefill_size=48,
                   max_prefill_tokens=96)
    first = served(models["target"], tmp_path, {"a": prompt}, GREEDY, **options)
    files = block_files(tmp_path)
    assert len(files) == (100 + 20) // 16  # the prompt's and its reply's whole blocks
    restart = served(models["target"], tmp_path, {"b": prompt}, GREEDY, **options)
    final = restart.finals["b"][0]
    assert final.cached_tokens == final.cached_tokens_disk == 96
    kept = run(models["target"], {"a": (prompt, GREEDY)}, **options)
    before = draft_counts(kept)
    kept.add("b", prompt, GREEDY)
    kept.run()
    assert kept.finals["b"][0].cached_tokens == 99
    after = draft_counts(kept)
    drafted, accepted, computed = draft_counts(restart)
    # the device's hit reaches 3 tokens further than the disk's whole blocks: the draft
    # computes those 3 after a restart
    assert (drafted, accepted, computed - 3) == tuple(
        a - b for a, b in zip(after, before, strict=True))
    assert restart.outputs["b"] == first.outputs["a"] == kept.outputs["b"]
    assert drafted > 0
    if draft == "same":
        assert accepted == drafted
    assert_draft_kv_is_a_fresh_prefills(restart, models[draft], least=96)


def test_blocks_written_with_another_draft_or_none_are_not_served(models, tmp_path):  # noqa: F811
    """The directory's fingerprint names the draft model (its weights, shapes and formats):
    blocks a server without a draft wrote are not read by one with a draft, nor the reverse,
    nor one draft's by another's; each writes its own, and a block holds the draft's KV and
    record after the target's."""
    prompt = np.random.default_rng(3).integers(3, VOCAB, 70).tolist()
    options = dict(page_size=4, num_pages=60, chunked_prefill_size=48, max_prefill_tokens=96)
    with_same = dict(options, speculative_config=spec(models["same"]))
    with_near = dict(options, speculative_config=spec(models["near"]))
    fingerprints = set()
    for rid, config in (("none", options), ("same", with_same), ("near", with_near),
                        ("none again", options), ("same again", with_same)):
        h = served(models["target"], tmp_path, {rid: prompt}, GREEDY, **config)
        hit = h.finals[rid][0].cached_tokens_disk
        assert hit == (64 if rid.endswith("again") else 0), rid
        fingerprints.add(h.worker.info.disk_fingerprint)
        if rid == "same":  # a block: the target's KV, the draft's, its tokens and flags
            io = h.worker.io
            assert io.model_bytes == page_bytes(models["target"], page_size=16)
            assert io.payload_bytes - io.model_bytes == page_bytes(
                models["same"], page_size=16) + 5 * 16
    assert len(fingerprints) == 3
    assert len(block_files(tmp_path)) == 3 * ((70 + 20) // 16)


def test_the_identity_names_the_draft(models):  # noqa: F811
    """``identity``: no draft is ``None``; a draft, its checkpoint's files, shapes and
    formats, which another draft's weights change."""
    from engine.worker.draft import DraftModel
    from engine.worker.runner import ModelRunner

    config = EngineConfig(model=models["target"], device="cpu", num_pages=8, dtype="float32",
                          quantization="none")
    runner = ModelRunner(config)
    assert identity(config, runner)["draft"] is None
    named = {}
    for draft in ("same", "near", "other"):
        c = EngineConfig(model=models["target"], device="cpu", num_pages=8, dtype="float32",
                         quantization="none", speculative_config=spec(models[draft]))
        ident = identity(c, runner, DraftModel(c, models[draft], 8, 0))
        named[draft] = fingerprint(ident)
        assert ident["draft"]["num_layers"] == ModelConfig.from_dir(models[draft]).num_layers
    assert len({*named.values(), fingerprint(identity(config, runner))}) == 4


def test_only_tensor_parallel_is_refused_with_a_draft(models, tmp_path):  # noqa: F811
    c = dict(model=models["target"], speculative_config=spec(models["same"]))
    EngineConfig(**c, host_cache_gb=1.0, disk_cache_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="--tp-size above 1"):
        EngineConfig(**c, tp_size=2).validate()


def test_forks_catching_up_on_a_shared_prompt_get_a_fresh_prefills_kv(models):  # noqa: F811
    """Two samples of a prompt whose head the draft computed for an earlier request: both
    catch the draft up on the rest of the prompt in one forward, over pages they share (the
    torch backend's cascade must not take those as a cached head): its KV there, where its
    record vouches, is a fresh prefill's."""
    head = prompts(1, seed=4, length=20)[0]
    tails = prompts(2, seed=5, length=12)
    h = Harness(models["target"], page_size=4, num_pages=256,
                speculative_config=spec(models["near"], k=3))
    h.add("a", head + tails[0], GREEDY)
    h.run()
    h.add("b", head + tails[1], SamplingParams(max_tokens=20, temperature=0.8, seed=1, n=2,
                                               ignore_eos=True))
    h.run()
    assert_draft_kv_is_a_fresh_prefills(h, models["near"], least=32)
