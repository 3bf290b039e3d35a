"""The ZMQ front door of a real ``radixserve serve --zmq-port`` process, through ``ZmqClient``
and ``AsyncZmqClient``: the same tokens as HTTP, errors, aborts and sessions."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import zmq

from engine.server.schemas import ChatCompletionChunk, CompletionChunk
from engine.server.zmq_client import AsyncZmqClient, ZmqAPIError, ZmqClient
from engine.server.zmq_messages import ErrorReply, reply_decoder
from tests.server_process import ServerProcess, free_port, metric_values

pytestmark = pytest.mark.e2e

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    zmq_port = free_port()
    srv = ServerProcess(tmp_path_factory.mktemp("zmq"), "--num-pages", "1024",
                        "--zmq-port", str(zmq_port))
    srv.zmq_url = f"tcp://127.0.0.1:{zmq_port}"
    assert srv.zmq_url in srv.ready_line
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def client(server):
    with ZmqClient(server.zmq_url) as c:
        yield c


def test_zmq_streams_the_same_tokens_as_http(server, client):
    body = {"input_ids": [11, 12, 13, 14, 15], "sampling_params": GREEDY}
    over_http = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    chunks = list(client.generate(body))
    ids = [t for chunk in chunks for c in chunk.choices for t in c.token_ids]
    assert ids == over_http["choices"][0]["token_ids"]
    assert chunks[-1].usage.completion_tokens == 12

    prompt = {"prompt": "Once upon a time", **GREEDY,
              "stream_options": {"include_usage": True}}
    text_http = httpx.post(f"{server.url}/v1/completions", json=prompt,
                           timeout=60).json()["choices"][0]["text"]
    chunks = list(client.completion(prompt))
    assert all(isinstance(c, CompletionChunk) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_http
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_async_client_runs_calls_concurrently(server):
    async def main() -> list[list[ChatCompletionChunk]]:
        client = AsyncZmqClient(server.zmq_url)
        try:
            async def one(i: int) -> list[ChatCompletionChunk]:
                body = {"messages": [{"role": "user", "content": f"question {i}"}], **GREEDY}
                return [chunk async for chunk in client.chat(body)]

            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            client.close()

    for chunks in asyncio.run(main()):
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"


def test_zmq_errors_carry_the_http_status(server, client):
    with pytest.raises(ZmqAPIError) as bad:
        list(client.completion({"prompt": "x", "temperature": -1}))
    assert bad.value.status == 400 and "temperature" in bad.value.message
    with pytest.raises(ZmqAPIError) as long_prompt:
        list(client.generate({"input_ids": [5] * 5000}))
    assert long_prompt.value.status == 400 and "context is 4,096" in long_prompt.value.message
    with pytest.raises(ZmqAPIError) as unknown:
        list(client.chat({"messages": [{"role": "user", "content": "x"}],
                          "session_id": "sess-none"}))
    assert unknown.value.status == 404
    # A message that is not a call gets an error reply, not silence.
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(server.zmq_url)
    raw.send(b"\x93not a call")
    assert raw.poll(10_000)
    reply = reply_decoder.decode(raw.recv())
    raw.close(linger=0)
    assert isinstance(reply, ErrorReply) and reply.status == 400
    assert list(client.generate({"input_ids": [5, 6], "sampling_params": {"max_tokens": 2}}))


def test_leaving_a_zmq_stream_aborts_the_request(server, client):
    stream = client.generate({"input_ids": [7, 8, 9], "sampling_params": {
        "max_tokens": 3000, "ignore_eos": True}})
    next(stream)
    assert wait_for_running(server, 1)  # the scheduler's stats come every 0.25 s while busy
    stream.close()
    assert wait_for_running(server, 0)


def wait_for_running(server, count: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric_values(server)["radixserve_num_requests_running"] == count:
            return True
        time.sleep(0.05)
    return False


def test_sessions_over_zmq(client):
    session = client.open_session()
    history = 0
    for turn in range(3):
        chunks = list(client.chat({
            "session_id": session.id, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"turn {turn}"}],
            "stream_options": {"include_usage": True}}))
        usage = chunks[-1].usage
        if turn:
            assert usage.prompt_tokens_details.cached_tokens == history
        history = usage.prompt_tokens + usage.completion_tokens
    assert client.close_session(session.id).deleted
    with pytest.raises(ZmqAPIError) as gone:
        client.close_session(session.id)
    assert gone.value.status == 404


def test_constraints_and_echo_over_zmq(client):
    """The ZMQ door takes the same bodies: a regex constraint on a completion, a choice on
    /generate, and echo with prompt logprobs."""
    import re

    chunks = list(client.completion({"prompt": "Call", "max_tokens": 12, "temperature": 1.0,
                                     "seed": 3, "structured_outputs": {"regex": "[0-9]{3}"}}))
    assert re.fullmatch("[0-9]{3}", "".join(c.choices[0].text for c in chunks if c.choices))
    chunks = list(client.generate({"text": "Pick:", "sampling_params": {
        "max_tokens": 8, "structured_outputs": {"choice": ["red", "blue"]}}}))
    assert "".join(c.text for chunk in chunks for c in chunk.choices) in ("red", "blue")
    chunks = list(client.completion({"prompt": [11, 12, 13], "max_tokens": 0, "echo": True,
                                     "logprobs": 1}))
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert len(logprobs) == 3 and logprobs[0] is None and all(lp < 0 for lp in logprobs[1:])
