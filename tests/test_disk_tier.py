"""The prefix cache's disk tier (``--disk-cache-dir``: engine/contracts/disk_cache.py,
scheduler/disk.py, engine/worker/tier_io.py) through the real scheduler and worker in-process
(tests/test_scheduler.py's harness: the accounting is checked after every step, the orphaned
pages of loads included): KV written to disk and loaded back into fresh pages is the KV
recompute gives, token for token against transformers in fp32, also when a new scheduler and
worker (a restart) read the directory; faulty files are skipped and recomputed; a directory
gone, or a store that cannot be set up on a full disk, leaves the server serving without the
tier (and ``/metrics`` saying so) until it can."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.contracts.disk_cache import DiskStore
from engine.contracts.sampling_params import SamplingParams
from tests.test_host_cache import host_cache_gb, prompts_with_prefixes, tail_variant
from tests.test_scheduler import GREEDY, Harness, hf_greedy, hf_model, model_dir  # noqa: F401


def disk_harness(model_dir: str, directory: Path, **options) -> Harness:  # noqa: F811
    options = {"page_size": 16, "num_pages": 12, "chunked_prefill_size": 48,
               "max_prefill_tokens": 96, **options}
    return Harness(model_dir, disk_cache_dir=str(directory), **options)


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*/*.kv"))


def close(h: Harness) -> None:
    """What a stopping worker does: write what is queued."""
    h.worker.io.close()


def served(model_dir: str, directory: Path, prompts: dict[str, list[int]],  # noqa: F811
           params: SamplingParams = GREEDY, **options) -> Harness:
    """A harness on ``directory`` that served ``prompts`` (by request id) together to the end
    and then wrote what was queued, as a server does before it stops: what a later one reads."""
    h = disk_harness(model_dir, directory, **options)
    for rid, prompt in prompts.items():
        h.add(rid, prompt, params)
    h.run()
    close(h)
    return h


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_loaded_from_disk_gives_the_same_tokens(model_dir, hf_model, tmp_path, page_size):  # noqa: F811
    """Prompts that outgrow a small device pool are written through to disk; asked again (and
    as variants that diverge inside a page), they load from disk: outputs equal transformers',
    usage counts the disk's tokens, and the loaded blocks reach the tree."""
    h = disk_harness(model_dir, tmp_path, page_size=page_size, num_pages=192 // page_size)
    prompts = prompts_with_prefixes(6, 60, seed=5)
    waves = [prompts, prompts, [tail_variant(p, i) for i, p in enumerate(prompts)]]
    for wave, batch in enumerate(waves):
        for i, p in enumerate(batch):
            h.add(f"w{wave}.{i}", p, GREEDY)
            h.run()
    close(h)
    for wave, batch in enumerate(waves):
        for i, p in enumerate(batch):
            assert h.outputs[f"w{wave}.{i}"][0] == hf_greedy(hf_model, p, 12), (wave, i)
    stats = h.sched.stats()
    assert stats["disk_blocks_loaded"] > 0 and stats["disk_load_failures"] == 0
    block = h.sched.disk.block
    for wave in (1, 2):
        finals = [h.finals[f"w{wave}.{i}"][0] for i in range(len(prompts))]
        assert all(f.cached_tokens_disk > 0 for f in finals[:4])  # evicted from the device
        assert all(f.cached_tokens_disk % block == 0 for f in finals)
        assert all(f.cached_tokens_disk <= f.cached_tokens for f in finals)
    assert h.finals["w0.0"][0].cached_tokens_disk == 0
    assert len(block_files(tmp_path)) >= 6 * (60 // block)


def test_a_restart_reads_the_directory(model_dir, hf_model, tmp_path):  # noqa: F811
    """A second scheduler and worker on the same directory (a restart) serve a prompt the first
    one computed from disk: every whole block below its last token, the same greedy output."""
    prompt = np.random.default_rng(8).integers(3, 4000, 200).tolist()
    first = served(model_dir, tmp_path, {"a": prompt}, num_pages=40)
    second = served(model_dir, tmp_path, {"b": prompt}, num_pages=40)
    final = second.finals["b"][0]
    assert final.cached_tokens == final.cached_tokens_disk == (len(prompt) - 1) // 16 * 16
    assert second.outputs["b"][0] == first.outputs["a"][0] == hf_greedy(hf_model, prompt, 12)


@pytest.mark.parametrize("fault", ["corrupt", "truncated", "foreign", "removed"])
def test_a_faulty_block_is_recomputed(model_dir, hf_model, tmp_path, fault):  # noqa: F811
    """A block file that is corrupt, truncated, from another model, or removed between the
    lookup and the load ends the load there: the rest is computed, the output is unchanged, the
    file is gone, and a later request writes it again."""
    prompt = np.random.default_rng(9).integers(3, 4000, 130).tolist()
    served(model_dir, tmp_path, {"a": prompt}, num_pages=40)
    files = block_files(tmp_path)
    assert len(files) == 130 // 16
    second = disk_harness(model_dir, tmp_path, num_pages=40)
    # The fourth block of the prompt's chain: find it by its place in the chain.
    names = second.sched.disk.lookup(prompt, None, 0, len(prompt) - 1)
    victim = second.sched.disk.store.path(names[3])
    if fault == "corrupt":
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif fault == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif fault == "foreign":
        # A valid block of another store (another model or layout) under this name.
        other = DiskStore(str(tmp_path), "ab" * 16)
        other.write(names[3], 16, bytes(100))
        victim.write_bytes(other.path(names[3]).read_bytes())
    second.add("b", prompt, GREEDY)
    if fault == "removed":
        second.step()  # admitted: the lookup found every block, the load is on its way
        victim.unlink()
    second.run()
    close(second)
    assert second.outputs["b"][0] == hf_greedy(hf_model, prompt, 12)
    final = second.finals["b"][0]
    assert final.cached_tokens_disk == 3 * 16
    stats = second.sched.stats()
    assert stats["disk_load_failures"] == 1
    assert stats["disk_rejected_files"] == (fault != "removed")
    assert victim.exists()  # written again from the recomputed KV


def test_an_abort_during_a_load_leaks_nothing(model_dir, tmp_path):  # noqa: F811
    """A request aborted while its blocks load: its pages wait for the load to end (the
    accounting after every step counts them), then go back; nothing leaks."""
    prompt = np.random.default_rng(10).integers(3, 4000, 150).tolist()
    served(model_dir, tmp_path, {"a": prompt}, num_pages=40)
    second = disk_harness(model_dir, tmp_path, num_pages=40)
    second.add("b", prompt, GREEDY)
    second.step()
    assert second.sched.loads.waiting
    second.sched.abort("b")
    assert second.sched.loads.orphans
    second.run()
    assert not second.sched.loads.orphans
    assert second.finals["b"][0].finish_reason == "abort"


@pytest.mark.slow
def test_forks_swaps_and_host_tier_with_disk(model_dir, hf_model, tmp_path):  # noqa: F811
    """Greedy forks (n = 2) of prompts loaded from disk, in a pool small enough to preempt by
    swap, with a host tier too: every sample equals transformers'."""
    page_size = 4
    options = {"page_size": page_size, "num_pages": 48, "preemption_mode": "swap",
               "num_host_pages": 64, "chunked_prefill_size": 32, "max_prefill_tokens": 64,
               "host_cache_gb": host_cache_gb(model_dir, 16, page_size)}
    prompts = prompts_with_prefixes(4, 40, seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=2)
    served(model_dir, tmp_path, {f"a{i}": p for i, p in enumerate(prompts)}, params, **options)
    second = served(model_dir, tmp_path, {f"b{i}": p for i, p in enumerate(prompts)}, params,
                    **options)
    for i, p in enumerate(prompts):
        want = hf_greedy(hf_model, p, 24)
        assert second.outputs[f"b{i}"] == {0: want, 1: want}, i
    assert second.sched.stats()["disk_blocks_loaded"] > 0


@pytest.mark.parametrize("tiers", ["host", "disk", "both"])
def test_the_profilers_replay_agrees_with_the_engine(model_dir, tmp_path, tiers):  # noqa: F811
    """The same requests served by the scheduler and worker and replayed by the profiler with
    the same tiers (engine/profiler/replay.py): hits per tier agree within 2 points of the
    prompt tokens."""
    from engine.profiler.replay import Tiers, replay
    from engine.profiler.trace import ReplayRequest

    page_size, num_pages, host_pages = 16, 24, 128
    options = {"num_pages": num_pages}
    if tiers in ("host", "both"):
        options["host_cache_gb"] = host_cache_gb(model_dir, host_pages, page_size)
    h = disk_harness(model_dir, tmp_path, **options) if tiers != "host" else Harness(
        model_dir, page_size=page_size, chunked_prefill_size=48, max_prefill_tokens=96, **options)
    prefixes = prompts_with_prefixes(10, 100, seed=12)
    rng = np.random.default_rng(13)
    prompts = [p[:100] + rng.integers(3, 4000, 5).tolist() for _ in range(3) for p in prefixes]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        h.add(str(i), p, params)
        h.run()
    finals = [h.finals[str(i)][0] for i in range(len(prompts))]
    served = {"host": sum(f.cached_tokens_host or 0 for f in finals),
              "disk": sum(f.cached_tokens_disk or 0 for f in finals)}
    served["device"] = sum(f.cached_tokens for f in finals) - served["host"] - served["disk"]
    requests = [ReplayRequest(str(i), float(i), np.asarray(p, dtype=np.int32),
                              np.asarray(h.outputs[str(i)][0], dtype=np.int32), None)
                for i, p in enumerate(prompts)]
    run = replay(requests, num_pages, page_size, tiers=Tiers(
        host_pages if tiers != "disk" else 0, disk_tokens=10**6 if tiers != "host" else 0))
    replayed = {tier: int(cached.sum()) for tier, cached in run.by_tier().items()}
    total = sum(len(p) for p in prompts)
    assert served["disk"] + served["host"] > 0.4 * total
    for tier, count in replayed.items():
        assert abs(count - served[tier]) <= 0.02 * total, (tier, served, replayed)


def test_blocks_the_tree_holds_are_written_again_once_they_left_the_disk(model_dir, tmp_path):  # noqa: F811
    """A prefix served from the device whose files were removed meanwhile (another server's
    trim) is written again by the next request that uses it."""
    prompt = np.random.default_rng(14).integers(3, 4000, 100).tolist()
    h = disk_harness(model_dir, tmp_path, num_pages=40)
    h.add("a", prompt, GREEDY)
    h.run()
    h.worker.io.close()  # every save written
    files = block_files(tmp_path)
    assert len(files) == (100 + 11) // 16
    for f in files:
        f.unlink()
    from engine.worker.tier_io import open_tier_io

    h.worker.io = open_tier_io(h.config, h.worker.runner)  # a fresh I/O thread
    h.add("b", prompt[:80] + [7, 8, 9], GREEDY)
    h.run()
    assert h.finals["b"][0].cached_tokens == 80  # from the device
    close(h)
    assert len(block_files(tmp_path)) >= 80 // 16


def test_a_batch_that_fails_before_its_loads_start_lets_them_end_empty(model_dir, hf_model,  # noqa: F811
                                                                        tmp_path, monkeypatch):
    """The worker fails the batch that carries a load before the load began (the run loop's
    ``handle``): the load is reported ended with no block, and the request computes its prompt
    instead of waiting forever."""
    from engine.contracts.protocol import decode, encode

    prompt = np.random.default_rng(15).integers(3, 4000, 120).tolist()
    served(model_dir, tmp_path, {"a": prompt}, num_pages=40)
    h = disk_harness(model_dir, tmp_path, num_pages=40)
    calls = []

    def broken(step):
        calls.append(step)
        raise ValueError("a write-down failed")

    monkeypatch.setattr(h.worker.runner, "write_down", broken)
    h.add("b", prompt, GREEDY)
    outputs, steps = [], 0
    while not h.sched.idle:
        batch = h.sched.schedule()
        if batch is not None:
            h.sched.process_result(decode(encode(h.worker.handle(decode(encode(batch))))))
            steps += 1
            if calls:
                monkeypatch.undo()  # one failure
        h.sched.check()
        outputs += h.sched.take_outputs().get(0, [])
        assert steps < 200
    close(h)
    assert len(calls) == 1
    tokens = [t for out in outputs for t in np.frombuffer(out.token_ids, np.int32).tolist()]
    assert tokens == hf_greedy(hf_model, prompt, 12)
    assert outputs[-1].cached_tokens_disk == 0 and h.sched.stats()["disk_load_failures"] == 1


def test_the_scheduler_stops_using_a_directory_the_worker_found_gone(model_dir, hf_model,  # noqa: F811
                                                                      tmp_path):
    """The store's directory removed while serving: the worker's I/O thread finds it gone
    (an lstat of the directory, not a missing file), and its next result tells the scheduler,
    whose handle then plans no more lookups or saves; outputs are unchanged."""
    import shutil

    rng = np.random.default_rng(16)
    prompts = [rng.integers(3, 4000, 70).tolist() for _ in range(3)]
    h = disk_harness(model_dir, tmp_path, num_pages=40)
    h.add("a", prompts[0], GREEDY)
    h.run()
    close(h)  # its saves written, so that nothing writes while the directory is removed
    from engine.worker.tier_io import open_tier_io

    h.worker.io = open_tier_io(h.config, h.worker.runner)  # a fresh I/O thread
    shutil.rmtree(h.worker.io.store.dir)
    h.add("b", prompts[1], GREEDY)
    h.run()
    close(h)  # its saves tried: the worker's store has found the directory gone
    assert not h.worker.io.store.enabled
    h.add("c", prompts[2], GREEDY)
    h.run()
    assert not h.sched.disk.store.enabled and h.sched.stats()["disk_on"] == 0
    assert not h.sched.disk.saves and h.sched.disk.lookup(prompts[2], None, 0, 64) == []
    for rid, prompt in zip("abc", prompts, strict=True):
        assert h.outputs[rid][0] == hf_greedy(hf_model, prompt, 12)


def disk_on_metric(h: Harness) -> bytes:
    """The ``/metrics`` line that says whether the disk tier serves, from the scheduler's stats."""
    from engine.contracts.protocol import SchedulerStats
    from engine.server.metrics import FrontendState, Metrics

    text = Metrics(lambda: SchedulerStats(**h.sched.stats()),
                   lambda: FrontendState(0, 0, True)).render()
    (line,) = [line for line in text.splitlines() if line.startswith(b"radixserve_disk_cache_on")]
    return line


def test_a_full_disk_at_start_serves_without_the_tier_until_it_can_be_set_up(
        model_dir, hf_model, tmp_path, monkeypatch):  # noqa: F811
    """The disk is full as the first server starts: its store's key cannot be written
    (ENOSPC). The worker starts anyway and serves without the tier: no lookups, nothing
    written, outputs unchanged, ``radixserve_disk_cache_on 0``. Once there is room (the
    back-off made 0 here), the next save sets the store up and writes, and the tier is on."""
    from engine.contracts import disk_cache

    def full(directory):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_cache, "FULL_RETRY_SECONDS", (0.0, 0.0))
    monkeypatch.setattr(disk_cache, "DirectoryKey", full)
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, 4000, 70).tolist() for _ in range(3)]
    h = disk_harness(model_dir, tmp_path, num_pages=40)
    assert not h.worker.info.disk_ready and not h.sched.disk.on
    h.add("a", prompts[0], GREEDY)
    h.run()
    h.worker.io.flush(30)  # a's saves tried, none left to land once the disk has room
    assert h.sched.stats()["disk_on"] == 0 and disk_on_metric(h) == b"radixserve_disk_cache_on 0.0"
    assert h.sched.disk.lookup(prompts[0], None, 0, 64) == [] and block_files(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.setattr(disk_cache, "FULL_RETRY_SECONDS", (0.0, 0.0))
    h.add("b", prompts[1], GREEDY)
    h.run()
    close(h)  # its saves written: the first set the store up
    assert len(block_files(tmp_path)) == (70 + 11) // 16  # b's, prompt and output
    h.add("c", prompts[2], GREEDY)
    h.run()  # whose results say so (c's own saves may then still be on their way)
    assert h.worker.io.store.ready and h.sched.disk.on
    assert disk_on_metric(h) == b"radixserve_disk_cache_on 1.0"
    for rid, prompt in zip("abc", prompts, strict=True):
        assert h.outputs[rid][0] == hf_greedy(hf_model, prompt, 12)
