"""`radixserve profile --url` against a real `radixserve serve` (its own, so that no other
test's prompts are in its cache)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from engine.cli import main as cli
from tests.server_process import ServerProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("server"), "--num-pages", "1024")
    yield srv
    assert srv.stop() == 0


def profile_live(server: ServerProcess, tmp_path: Path, workload: list[str],
                 profile: list[str]) -> Path:
    """A shared-prefix trace (``radixserve workload gen`` with ``workload``) profiled against
    ``server`` (``radixserve profile --url`` with ``profile``): the report's directory."""
    trace = tmp_path / "trace.jsonl"
    assert cli(["workload", "gen", "shared-prefix", "--out", str(trace), "--vocab-size", "4000",
                *workload]) == 0
    out = tmp_path / "report"
    assert cli(["profile", str(trace), "--url", server.url, "--out", str(out), *profile]) == 0
    return out


def test_live_replay_matches_its_simulation_request_by_request(server, tmp_path):
    # One request at a time, at the trace's arrival times: a sequential trace.
    out = profile_live(server, tmp_path,
                       ["--seed", "5", "--groups", "3", "--prompts-per-group", "4",
                        "--system-len", "45", "--question-len", "7", "--output-len", "4"],
                       ["--max-concurrency", "1", "--num-pages", "512"])
    with open(out / "live_requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12
    assert [int(r["cached_tokens"]) for r in rows] == [int(r["sim_cached_tokens"]) for r in rows]
    assert sum(int(r["cached_tokens"]) for r in rows) > 0


def test_offline_model_on_the_live_timeline_agrees_at_8_in_flight(server, tmp_path):
    """Eight requests in flight, sent as fast as they go: many share a head another request is
    still prefilling. The offline replay on the live run's own timeline (each request holding
    its pages from send to finish, the prompt cached at its first token) must land within 5
    points of the hit rate the server reports (docs/profiler.md states the tolerance)."""
    out = profile_live(server, tmp_path,
                       ["--seed", "7", "--groups", "6", "--prompts-per-group", "8",
                        "--system-len", "300", "--question-len", "20", "--output-len", "16"],
                       ["--max-concurrency", "8", "--rate", "5000", "--num-pages", "1024"])
    summary = json.loads((out / "live_summary.json").read_text())
    timed = summary["timed_simulation"]
    assert summary["succeeded"] == 48 and timed["peak_running"] > 1
    assert abs(timed["gap_points"]) <= 5.0, summary
