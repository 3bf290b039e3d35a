"""Live replay against a small fake OpenAI-compatible server started in the test.

The fake keeps every prompt it has seen and reports, as ``cached_tokens``, the longest common
prefix with any of them (at most len - 1): an unlimited token-granular cache that stores
prompts only, which on traces whose outputs are never re-sent is what the offline simulation of
an unlimited cache computes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.cli import main

API_KEY = "sk-test"


@dataclass
class FakeState:
    prompts: list[list[int]] = field(default_factory=list)
    calls: list[tuple[str, dict]] = field(default_factory=list)


def _tokens(body: dict) -> list[int]:
    if "messages" in body:  # a stand-in tokenizer: one token per character
        return [ord(c) for m in body["messages"] for c in f"{m['role']}:{m['content']}\n"]
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]


def _cached(seen: list[list[int]], prompt: list[int]) -> int:
    best = 0
    for earlier in seen:
        n = 0
        while n < min(len(earlier), len(prompt)) and earlier[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1)


def fake_app(state: FakeState) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request: Request) -> JSONResponse | StreamingResponse:
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": {"message": "bad key", "type": "auth"}}, 401)
        body = await request.json()
        state.calls.append((request.url.path, body))
        prompt = _tokens(body)
        cached = _cached(state.prompts, prompt)
        state.prompts.append(prompt)
        chat = request.url.path.endswith("chat/completions")

        async def stream():
            await asyncio.sleep(0.001 * (len(prompt) - cached) / 100)  # uncached prefill time
            if chat:
                yield f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant'}}]})}\n\n"
            for _ in range(body["max_tokens"]):
                choice = {"delta": {"content": "x"}} if chat else {"text": "x"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/completions", complete, methods=["POST"]),
                             Route("/v1/chat/completions", complete, methods=["POST"])])


@pytest.fixture
def fake_server():
    state = FakeState()
    server = uvicorn.Server(uvicorn.Config(fake_app(state), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def test_live_token_trace_matches_the_offline_simulation(fake_server, tmp_path, capsys):
    url, state = fake_server
    trace = tmp_path / "shared.jsonl"
    main(["workload", "gen", "shared-prefix", "--seed", "1", "--out", str(trace), "--groups", "2",
          "--prompts-per-group", "4", "--system-len", "50", "--question-len", "7",
          "--output-len", "3"])
    out = tmp_path / "live"
    # One request in flight at a time: the fake sees them in trace order, as the simulation does.
    assert main(["profile", str(trace), "--url", url + "/v1", "--api-key", API_KEY,
                 "--rate", "200", "--max-concurrency", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured hit rate" in printed and "offline simulation" in printed

    summary = json.loads((out / "live_summary.json").read_text())
    assert summary["model"] == "fake-model" and summary["succeeded"] == 8
    assert summary["cached_tokens"] > 0
    assert summary["hit_rate"] == pytest.approx(summary["simulation"]["hit_rate"])
    assert summary["simulation"]["mean_gap_tokens"] == 0
    assert summary["simulation"]["prompt_length_mismatches"] == 0
    assert summary["ttft_by_cached_fraction"] and summary["ttft_fit"] is not None

    path, body = state.calls[0]
    assert path == "/v1/completions" and isinstance(body["prompt"], list)
    assert body["max_tokens"] == 3 and body["temperature"] == 0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    for name in ("live_requests.csv", "ttft_vs_cached.png", "summary.json"):
        assert (out / name).stat().st_size > 0


def test_live_chat_trace_uses_chat_completions(fake_server, tmp_path, capsys):
    url, state = fake_server
    trace = tmp_path / "chat.jsonl"
    lines = [{"id": f"c{i}", "arrival": 0.01 * i, "max_tokens": 2, "session_id": "s",
              "messages": [{"role": "system", "content": "You are terse. " * 8},
                           {"role": "user", "content": f"question {i}"}]} for i in range(4)]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["profile", str(trace), "--url", url, "--model", "m", "--api-key", API_KEY]) == 0
    printed = capsys.readouterr().out
    assert "no offline comparison" in printed
    assert {path for path, _ in state.calls} == {"/v1/chat/completions"}
    assert all(body["model"] == "m" and body["messages"] for _, body in state.calls)


def test_live_errors_are_reported_not_raised(fake_server, tmp_path, capsys):
    url, _ = fake_server
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "prompt_token_ids": [1, 2, 3], "max_tokens": 1}\n')
    assert main(["profile", str(trace), "--url", url, "--api-key", "wrong"]) == 1
    assert "HTTP 401" in capsys.readouterr().out
    assert main(["profile", str(trace), "--url", "http://127.0.0.1:9"]) == 1
    assert "pass --model NAME" in capsys.readouterr().err
