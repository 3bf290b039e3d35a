"""The radix replay with requests overlapping in time and with a host and a disk tier
(engine/profiler/replay.py)."""

from __future__ import annotations

import csv
import json

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from engine.cli import main
from engine.profiler.replay import ServiceModel, Tiers, replay
from engine.profiler.simulate import replay_radix, replay_unlimited
from engine.profiler.trace import ReplayRequest


def req(rid: str, arrival: float, prompt: list[int], output_len: int = 4,
        namespace: str | None = None) -> ReplayRequest:
    output = np.full(output_len, 10_000 + int(rid.strip("abcdefghijklmnopqrstuvwxyz") or 0),
                     dtype=np.int32)
    return ReplayRequest(rid, arrival, np.asarray(prompt, dtype=np.int32), output, namespace)


HEAD = list(range(1, 65))  # a 64-token shared head


def group(n: int, spacing: float) -> list[ReplayRequest]:
    return [req(f"r{i}", i * spacing, HEAD + [100 + i] * 8) for i in range(n)]


def test_without_a_service_model_the_replay_is_serial():
    requests = group(6, 0.0)
    serial = replay(requests, 64, 16)
    timed = replay(requests, 64, 16, service=ServiceModel())
    assert serial.cached.tolist() == timed.cached.tolist() == [0] + [64] * 5
    assert serial.peak_running == 1 and serial.visible is None


def test_a_head_still_being_prefilled_is_not_a_hit_yet():
    """Six requests 1 ms apart; prefill of 72 tokens at 10k tokens/s takes 7.2 ms: without
    waiting for a shared head (vLLM), the ones that arrive before the first has prefilled
    cannot hit its head; later ones can."""
    requests = group(6, 0.001)
    service = ServiceModel(prefill_tps=10_000, decode_tps=1_000, head_wait=False)
    run = replay(requests, 1024, 16, service=service)
    # r0 prefills until 7.2 ms; r1..r5 arrive at 1..5 ms and miss; nothing else was in the tree.
    assert run.cached.tolist() == [0] * 6
    assert run.visible.tolist() == [0] * 6  # an unlimited cache on the same timeline: the same
    assert run.peak_running == 6
    late = requests + [req("r6", 0.008, HEAD + [106] * 8)]
    assert replay(late, 1024, 16, service=service).cached[-1] == 64
    # Serially every later request hits the whole head.
    assert replay(requests, 1024, 16).cached.tolist() == [0] + [64] * 5


def test_a_request_waits_for_the_shared_head_being_prefilled_then_hits_it():
    """radixserve's scheduler (and SGLang's) hold back a request whose first 32 tokens another
    request is prefilling, when it would compute more than 64 tokens itself."""
    requests = group(6, 0.001)
    run = replay(requests, 1024, 16, service=ServiceModel(prefill_tps=10_000, decode_tps=1_000))
    assert run.cached.tolist() == [0] + [64] * 5
    assert run.waited_s == pytest.approx(sum(0.0072 - 0.001 * i for i in range(1, 6)))
    short = [req(f"r{i}", i * 0.001, HEAD[:40] + [100 + i] * 8) for i in range(3)]  # 48 tokens
    run = replay(short, 1024, 16, service=ServiceModel(prefill_tps=1_000))
    assert run.cached.tolist() == [0, 0, 0] and run.waited_s == 0  # too short to wait for


def test_requests_in_flight_hold_their_pages_and_later_ones_wait_for_room():
    """Room for two requests' pages: the third waits until the first finishes."""
    requests = [req(f"r{i}", 0.0, [i + 1] * 60, output_len=4) for i in range(3)]  # 4 pages each
    service = ServiceModel(prefill_tps=6_000, decode_tps=400)  # 10 ms prefill, 10 ms decode
    run = replay(requests, 8, 16, service=service)
    assert run.peak_running == 2
    assert run.waited_s == pytest.approx(0.02)  # r2 started when r0 finished, at 20 ms
    capped = replay(requests, 1024, 16, service=ServiceModel(1_000, 1_000, max_concurrency=1))
    assert capped.peak_running == 1 and capped.waited_s > 0


def test_live_measurements_replace_the_rates_and_the_arrivals():
    requests = group(3, 0.001)
    measured = {"r0": (0.0, 0.0005, 0.0006), "r1": (0.001, 0.05, 0.06)}  # r0 done at 0.6 ms
    run = replay(requests, 1024, 16, service=ServiceModel(prefill_tps=1.0, measured=measured))
    # r1 hits r0's head; r2 (1 token/s prefill, from its trace arrival) hits it too.
    assert run.cached.tolist() == [0, 64, 64]
    late = {**measured, "r0": (0.0, 0.01, 0.02)}  # r0 prefills until 10 ms: r1 and r2 miss
    no_wait = ServiceModel(measured=late, head_wait=False)
    assert replay(requests, 1024, 16, service=no_wait).cached.tolist() == [0, 0, 0]
    sent_late = {**late, "r1": (0.015, 0.05, 0.06)}  # r1 was sent at 15 ms: its send time counts
    run = replay(requests, 1024, 16, service=ServiceModel(measured=sent_late, head_wait=False))
    # r2 (trace arrival 2 ms) queues behind r1 until 15 ms: first come, first served.
    assert run.cached.tolist() == [0, 64, 64] and run.waited_s == pytest.approx(0.013)


def test_the_host_tier_serves_what_the_device_evicted():
    a, b = [1] * 60 + [2], [3] * 60 + [4]
    requests = [req("r0", 0, a), req("r1", 1, b), req("r2", 2, a[:-1] + [5])]
    no_host = replay(requests, 6, 16)  # room for one request: r1 evicts r0
    assert no_host.cached.tolist() == [0, 0, 0]
    # r2 needs 6 pages: 4 to load r0's 60 tokens into (a partial page at 60) and 2 of its own
    run = replay(requests, 6, 16, tiers=Tiers(64))
    assert run.cached.tolist() == [0, 0, 0]
    assert run.host_cached.tolist() == [0, 0, 60]  # found on host, loaded instead of computed
    small_host = replay(requests, 6, 16, tiers=Tiers(4))  # no room for r0's 5 pages
    assert small_host.host_cached.tolist() == [0, 0, 0]
    # write_through copies r0 down as it is cached: the same hit, by another route
    through = replay(requests, 6, 16, tiers=Tiers(64, "write_through"))
    assert through.host_cached.tolist() == [0, 0, 60]


def test_the_disk_tier_serves_whole_blocks_past_the_tree():
    """r0 is evicted from a one-request pool; its whole 16-token blocks, written through to the
    disk tier, serve r2 (whose match may go to 60 tokens: 3 whole blocks); a disk too small
    for r0's first block by the time r2 comes serves nothing (the chain starts at block 0)."""
    a, b = [1] * 60 + [2], [3] * 60 + [4]
    requests = [req("r0", 0, a), req("r1", 1, b), req("r2", 2, a[:-1] + [5])]
    run = replay(requests, 5, 16, tiers=Tiers(disk_tokens=4096))
    assert run.cached.tolist() == [0, 0, 0] and run.host_cached is None
    assert run.disk_cached.tolist() == [0, 0, 48]
    small = replay(requests, 5, 16, tiers=Tiers(disk_tokens=64))  # b's 4 blocks push a's out
    assert small.disk_cached.tolist() == [0, 0, 0]
    both = replay(requests, 6, 16, tiers=Tiers(64, disk_tokens=4096))
    assert both.host_cached.tolist() == [0, 0, 60] and both.disk_cached.tolist() == [0, 0, 0]


def test_a_request_that_waits_for_room_still_loads_from_disk():
    """r2 arrives while r1 holds the whole pool and waits for it: admitted then, it still
    finds r0's blocks on disk (the lookup is made again at each try, from the whole prompt)."""
    a, b = [1] * 60 + [2], [3] * 60 + [4]
    requests = [req("r0", 0, a), req("r1", 1, b, output_len=30), req("r2", 1.01, a[:-1] + [5])]
    service = ServiceModel(prefill_tps=1_000, decode_tps=100, head_wait=False)
    run = replay(requests, 6, 16, service=service, tiers=Tiers(disk_tokens=4096))
    assert run.waited_s > 0 and run.disk_cached.tolist() == [0, 0, 48]


def test_replay_radix_reports_the_new_fields():
    requests = group(4, 0.001)
    run = replay_radix(requests, 1024, 16, service=ServiceModel(10_000, head_wait=False),
                       tiers=Tiers(2048, disk_tokens=4096))
    assert run.visible is not None and run.host_cached is not None and run.peak_running == 4
    assert run.disk_cached is not None and set(run.by_tier()) == {"device", "host", "disk"}


prompts = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=48), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(prompts=prompts, page_size=st.sampled_from([1, 4, 16]), num_pages=st.integers(0, 40),
       gaps=st.lists(st.floats(0, 0.01), min_size=24, max_size=24),
       prefill_tps=st.sampled_from([None, 2_000.0, 20_000.0]),
       decode_tps=st.sampled_from([None, 500.0]), host=st.sampled_from([0, 8, 200]),
       cap=st.sampled_from([None, 1, 3]), disk=st.sampled_from([0, 32, 4096]),
       write_policy=st.sampled_from(["write_back", "write_through", "write_through_selective"]))
def test_hits_never_exceed_what_was_visible_or_what_an_unlimited_serial_cache_finds(
        prompts, page_size, num_pages, gaps, prefill_tps, decode_tps, host, cap, disk,
        write_policy):
    arrivals = np.cumsum(gaps[: len(prompts)])
    requests = [req(f"r{i}", float(t), p, output_len=2)
                for i, (t, p) in enumerate(zip(arrivals, prompts, strict=True))]
    num_pages += -(-50 // page_size)  # at least one request's worth
    service = ServiceModel(prefill_tps, decode_tps, max_concurrency=cap)
    run = replay(requests, num_pages, page_size, service=service,
                 tiers=Tiers(host, write_policy, disk))
    unlimited = replay_unlimited(requests, page_size).cached
    prompt_len = np.array([len(p) for p in prompts])
    assert (run.cached <= prompt_len - 1).all()
    visible = run.visible if run.visible is not None else unlimited
    assert (run.cached <= visible).all() and (visible <= unlimited).all()
    total = run.cached + (run.host_cached if host else 0) + (run.disk_cached if disk else 0)
    assert (total <= visible).all() and (total <= prompt_len - 1).all()


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_profile_cli_with_overlap_and_a_host_tier(tmp_path, capsys):
    trace = tmp_path / "shared.jsonl"
    assert main(["workload", "gen", "shared-prefix", "--seed", "3", "--out", str(trace),
                 "--groups", "4", "--prompts-per-group", "6", "--system-len", "200",
                 "--question-len", "20", "--output-len", "30"]) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["profile", str(trace), "--cache-tokens", "1024", "--page-size", "16",
                 "--prefill-tps", "200", "--decode-tps", "20", "--max-concurrency", "8",
                 "--no-head-wait",
                 "--host-cache-tokens", "8192", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "in flight" in printed and "requests overlapping in time (prefill 200" in printed
    assert "host tier of 8,192 tokens" in printed
    summary = json.loads((out / "summary.json").read_text())
    att = summary["attribution"]
    assert att["prompt_tokens"] == att["hit"] + att["cold"] + att["in_flight"] + att["evicted"]
    assert att["in_flight"] > 0 and 0 < att["host_hit"] <= att["evicted"]
    assert summary["concurrency"]["peak_running"] > 1
    for row in _rows(out / "requests.csv"):
        parts = [int(row[k]) for k in ("cached_tokens", "cold", "in_flight", "evicted")]
        assert sum(parts) == int(row["prompt_tokens"]) and int(row["host_hit"]) <= parts[3]
    # The same trace replayed serially has nothing in flight and hits more.
    assert main(["profile", str(trace), "--cache-tokens", "1024", "--page-size", "16",
                 "--out", str(tmp_path / "serial")]) == 0
    serial = json.loads((tmp_path / "serial" / "summary.json").read_text())
    assert serial["concurrency"] is None and serial["attribution"]["in_flight"] == 0
    assert serial["caches"][0]["hit_rate"] > summary["caches"][0]["hit_rate"]


def test_durations_come_from_a_live_requests_csv(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "shared-prefix", "--seed", "1", "--out", str(trace),
                 "--groups", "1", "--prompts-per-group", "3", "--system-len", "64",
                 "--question-len", "8", "--output-len", "4"]) == 0
    ids = [json.loads(line)["id"] for line in trace.read_text().splitlines()]
    live = tmp_path / "live_requests.csv"
    with open(live, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "sent_at_s", "prompt_tokens", "cached_tokens", "ttft_s",
                         "latency_s", "error"])
        for id_ in ids:  # all sent at once, each prefilling for a second: nobody hits
            writer.writerow([id_, 0.0, "", "", 1.0, 2.0, ""])
    capsys.readouterr()
    # An engine that admits requests sharing a head together (vLLM): --no-head-wait.
    assert main(["profile", str(trace), "--durations", str(live), "--no-head-wait", "--out",
                 str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["caches"][0]["hit_tokens"] == 0 and summary["attribution"]["in_flight"] > 0
    assert "timings of a live replay for 3 requests" in summary["concurrency"]["model"]
    bad = tmp_path / "bad.csv"
    bad.write_text("id,latency_s\nx,1\n")
    assert main(["profile", str(trace), "--durations", str(bad)]) == 2
    assert "not a live_requests.csv (no sent_at_s, ttft_s column)" in capsys.readouterr().err
