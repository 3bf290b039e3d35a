"""``radixserve profile --sliding-kv-ratio``: the replay with the sliding-window layers' own pool
(engine/profiler/sliding.py), on traces whose hits are known by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.cli import main
from engine.profiler.kv_bytes import KVBytes, KVShape
from engine.profiler.replay import Tiers
from engine.profiler.simulate import run_profile
from engine.profiler.sliding import SlidingLayers, SlidingPools, read_layers
from engine.profiler.trace import ReplayRequest
from engine.worker.model.config import ModelConfig
from tests.conftest_models import write_checkpoint

PAGE, WINDOW, CHUNK = 4, 8, 8
A = list(range(1, 41))  # a 40-token prompt


def req(rid: str, prompt: list[int], output: list[int]) -> ReplayRequest:
    return ReplayRequest(rid, float(len(rid)), np.asarray(prompt, dtype=np.int32),
                         np.asarray(output, dtype=np.int32), None)


OUT0, OUT1 = [500, 501, 502, 503], [600, 601, 602, 603]
TRACE = [req("r0", A, OUT0),
         req("r1", A, OUT1),  # an exact resend: the window where A ends is kept
         req("r2", A[:24] + list(range(900, 916)), [700] * 4),  # shares 24 tokens, no window
         req("r3", A + OUT0 + list(range(800, 808)), [701] * 4)]  # r0's next turn
POOLS = SlidingPools(SlidingLayers(5, 6, WINDOW, "test"), 0.5, CHUNK)


def test_matches_end_where_a_kept_window_is_and_full_kv_hits_more():
    """64 full pages and 32 sliding ones: nothing is evicted. The resend hits all but its last
    token and the next turn its whole history (their windows were kept where A and r0 end);
    r2's 24 shared tokens have no window of sliding KV before their end (the windows kept
    are at positions 32-44), so it hits nothing, where full KV in the same memory (37 pages of
    every layer) hits them."""
    profile = run_profile(TRACE, 64, PAGE, sliding=POOLS)
    assert profile.radix.cached.tolist() == [0, 39, 0, 44]
    assert profile.full_kv.cached.tolist() == [0, 39, 24, 44]
    assert profile.full_kv.capacity_tokens == (64 * 1 + 32 * 5) // 6 * PAGE
    assert profile.radix.sliding["pages"] == 32
    # a running request holds its window and a prompt chunk (W + chunk) / P pages at most
    assert profile.radix.sliding["peak_pages"] == (WINDOW + CHUNK) // PAGE
    assert profile.radix.sliding["evicted_window_pages"] == 0


def test_kept_windows_go_first_when_the_sliding_pool_is_short():
    """6 sliding pages (the least for a chunk and its window): after r1 and r2 the windows kept
    at A's end are evicted to make room, so r3 finds no window before its match's end; its
    full KV stays cached (it is not evicted: the full pool has room)."""
    pools = SlidingPools(POOLS.layers, 6 / 64, CHUNK)
    profile = run_profile(TRACE, 64, PAGE, sliding=pools)
    assert profile.radix.sliding["pages"] == 6
    assert profile.radix.sliding["evicted_window_pages"] > 0
    assert profile.radix.evicted_tokens == 0
    assert profile.radix.cached.tolist()[:2] == [0, 39]
    assert profile.radix.cached[3] < 44


def test_a_sliding_pool_smaller_than_a_chunk_and_its_window_is_refused():
    with pytest.raises(ValueError, match="fewer than one prompt chunk and its window need"):
        run_profile(TRACE, 64, PAGE, sliding=SlidingPools(POOLS.layers, 5 / 64, CHUNK))


def test_pools_sized_in_bytes_as_the_engine_sizes_them():
    """--cache-gb: a full page carries its layers' KV and R of a sliding page's."""
    shape = KVShape(num_layers=6, num_kv_heads=1, head_dim=64, model_dtype="bfloat16",
                    source="test")
    kv = KVBytes.of_model(shape, "auto")  # 2 x 6 x 64 x 2 = 1536 bytes a token
    per_layer_page = 1536 * PAGE // 6
    pages = POOLS.pages_in(kv, 1.0, PAGE)
    assert pages == (1 << 30) // (per_layer_page + per_layer_page * 5 // 2)
    size = POOLS.pool_bytes(kv, pages, PAGE)
    assert size["full_pool"] + size["sliding_pool"] <= 1 << 30
    assert size["full_kv"] <= size["full_pool"] + size["sliding_pool"]


def test_layers_read_from_a_checkpoint(tmp_path):
    model = write_checkpoint(tmp_path / "model", "gemma3", sliding_window=16,
                             num_hidden_layers=3, max_position_embeddings=512,
                             layer_types=["sliding_attention", "sliding_attention",
                                          "full_attention"])
    layers = read_layers(model)
    assert (layers.num_sliding, layers.num_layers, layers.window) == (2, 3, 16)
    # the engine's own reading of the same config
    windows = ModelConfig.from_dir(model).sliding_windows
    assert (sum(w is not None for w in windows), len(windows)) == (2, 3)
    assert set(windows) == {16, None}
    llama = write_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="has no sliding-window layer"):
        read_layers(llama)


def write_trace(path, requests) -> None:
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"id": r.id, "arrival": r.arrival,
                                "prompt_token_ids": r.prompt.tolist(),
                                "output_token_ids": r.output.tolist()}) + "\n")


def test_the_command_reports_both_pools_and_full_kv(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    out = tmp_path / "out"
    assert main(["profile", str(trace), "--num-pages", "64", "--page-size", str(PAGE),
                 "--sliding-kv-ratio", "0.5", "--sliding-window", str(WINDOW),
                 "--sliding-layers", "5/6", "--chunked-prefill-size", str(CHUNK),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sliding-window layers: 5 of 6 layers see the last 8 positions" in text
    assert "full pool 64 pages + sliding pool 32 pages: hit rate" in text
    assert "full KV in the same memory: 37 pages" in text
    summary = json.loads((out / "summary.json").read_text())["sliding"]
    total = sum(len(r.prompt) for r in TRACE)
    assert summary["hit_rate"] == pytest.approx(83 / total)
    assert summary["full_kv_hit_rate"] == pytest.approx(107 / total)


B, C = list(range(100, 140)), list(range(200, 240))  # two more 40-token prompts
# Three prompts, then a resend of A, B's next turn and C's first 36 tokens: a 24-page device
# cache holds two requests' pages (11 each), so A and B have left it by the time they return.
HOST_TRACE = [req("a0", A, [1] * 4), req("b0", B, [2] * 4), req("c0", C, [3] * 4),
              req("a1", A, [4] * 4), req("b1", B + [5] * 8, [6] * 4), req("c1", C[:36], [7] * 4)]


def test_a_host_tier_keeps_what_the_device_lets_go_with_its_windows():
    """Without a host tier nothing hits (each prompt has left the device when it returns).
    With one (64 pages, 32 for windows) A's resend hits 39 tokens and B's next turn 40, loaded
    from the host tier: each node took the windows it kept where its prompt and its request
    ended down with it. C's first 36 tokens hit nothing: the window before 35 (positions 28-34)
    was never kept, where full KV in the same memory (14 pages, a 36-page host tier) hits 35."""
    alone = run_profile(HOST_TRACE, 24, PAGE, sliding=POOLS)
    assert alone.radix.cached.sum() == 0 and alone.radix.host_cached is None
    profile = run_profile(HOST_TRACE, 24, PAGE, sliding=POOLS, tiers=Tiers(64))
    assert profile.radix.cached.tolist() == [0] * 6
    assert profile.radix.host_cached.tolist() == [0, 0, 0, 39, 40, 0]
    assert profile.radix.sliding["host_pages"] == 64
    assert profile.radix.sliding["host_window_pages"] == 32
    assert profile.full_kv.capacity_tokens == 14 * PAGE
    assert profile.full_kv.host_cached.tolist() == [0, 0, 0, 39, 40, 35]
    # a host tier with too few window pages for both: B's windows push A's out
    short = run_profile(HOST_TRACE, 24, PAGE, sliding=POOLS, tiers=Tiers(16))
    assert short.radix.sliding["host_window_pages"] == 8
    assert short.radix.host_cached.tolist() == [0, 0, 0, 39, 0, 0]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_where_windows_are_never_the_limit_the_tiers_hit_what_full_kv_hits(policy):
    """Ratio 1 (as many sliding pages as full ones: full KV's memory) on resends and next
    turns only, every match ends where a kept window does: device and host hits equal the
    full-KV replay's, split between the tiers alike."""
    trace = HOST_TRACE[:5]
    pools = SlidingPools(POOLS.layers, 1.0, CHUNK)
    for pages, host in ((24, 16), (64, 64), (24, 64)):
        profile = run_profile(trace, pages, PAGE, sliding=pools, tiers=Tiers(host, policy))
        assert profile.full_kv.capacity_tokens == pages * PAGE
        assert profile.radix.cached.tolist() == profile.full_kv.cached.tolist()
        assert profile.radix.host_cached.tolist() == profile.full_kv.host_cached.tolist()
    assert profile.radix.host_cached.sum() == 79  # (24, 64): A's resend and B's next turn


def test_a_host_tier_in_gib_is_sized_as_the_engines(tmp_path, capsys):
    """--host-cache-gb with --sliding-kv-ratio: a host page pays for its share of a window
    page, as engine/worker/runner.py sizes it."""
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, HOST_TRACE)
    out = tmp_path / "out"
    gib = 64 * 3584 / (1 << 30)  # a host page: 1,024 bytes of its layer + 2,560 of windows'
    assert main(["profile", str(trace), "--num-pages", "24", "--page-size", str(PAGE),
                 "--sliding-kv-ratio", "0.5", "--sliding-window", str(WINDOW),
                 "--sliding-layers", "5/6", "--chunked-prefill-size", str(CHUNK),
                 "--kv-bytes-per-token", "1536", "--host-cache-gb", repr(gib),
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("host tier: full pool 64 pages (64.0 KiB) + sliding pool 32 pages (160.0 KiB): "
            "hit rate device 0.0% + host 32.4% = 32.4% (0 windows' pages read back under "
            "device nodes); full KV in the same memory: 37 pages (222.0 KiB): 0.0% + 46.7% = "
            "46.7%") in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["host_tier"]["capacity_tokens"] == 64 * PAGE
    assert summary["host_tier"]["capacity_bytes"] == 64 * 3584
    assert summary["sliding"]["host_hit_rate"] == pytest.approx(79 / 244)


@pytest.mark.parametrize(("flags", "message"), [
    (["--sliding-window", "8"], "describe the model for --sliding-kv-ratio"),
    (["--sliding-kv-ratio", "0.5"], "needs the model's sliding layers"),
    (["--sliding-kv-ratio", "1.5", "--sliding-window", "8", "--sliding-layers", "5/6"],
     "from 0 to 1"),
    (["--sliding-kv-ratio", "0.5", "--sliding-window", "8", "--sliding-layers", "6/5"],
     "K must be from 1 to L"),
    (["--sliding-kv-ratio", "0.5", "--sliding-window", "8", "--sliding-layers", "5/6",
      "--sweep"], "drop --sweep"),
    (["--sliding-kv-ratio", "0.5", "--sliding-window", "8", "--sliding-layers", "5/6",
      "--prefill-tps", "1000"], "one request at a time"),
    (["--sliding-kv-ratio", "0.5", "--sliding-window", "8", "--sliding-layers", "5/6",
      "--disk-cache-tokens", "1024"], "replayed without a disk tier"),
    (["--sliding-kv-ratio", "0.5", "--sliding-window", "8", "--sliding-layers", "5/6",
      "--kv-bytes-per-token", "1536", "--host-cache-gb", "0.000001"],
     "--host-cache-gb 1e-06 holds no page of both pools"),
])
def test_bad_sliding_flags_are_sentences(tmp_path, capsys, flags, message):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    assert main(["profile", str(trace), "--num-pages", "64", "--page-size", str(PAGE),
                 *flags]) == 2
    assert message in capsys.readouterr().err
