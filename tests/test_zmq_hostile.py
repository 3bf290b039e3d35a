"""The ZMQ front door under hostile input, on a real ``radixserve serve --api-key --zmq-port``:
wrong frame counts, garbage, nesting 10^5 deep and calls without the key each get an
``ErrorReply`` (never silence), a hypothesis fuzz over frames does the same, and after all of
it a valid call still streams tokens. Also: the door binds where HTTP binds, and a receive loop
that dies turns ``/health`` 503."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.server.app import build_app
from engine.server.service import Service
from engine.server.zmq_client import ZmqAPIError, ZmqClient
from engine.server.zmq_frontend import ZmqFrontend
from engine.server.zmq_messages import (
    AbortCall,
    Done,
    ErrorReply,
    SessionReply,
    ZmqReply,
    call_decoder,
    reply_decoder,
)
from tests.server_process import API_KEY, AUTH, ServerProcess, free_port
from tests.test_server_app import INFO, ScriptedClient

DEEP = b"\x91" * 100_000 + b"\xc0"  # a msgpack array nested 10^5 deep
CALL_TYPES = ["CompletionCall", "ChatCall", "GenerateCall", "OpenSessionCall",
              "CloseSessionCall", "AbortCall", "Done", "NoSuchCall"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    zmq_port = free_port()
    srv = ServerProcess(tmp_path_factory.mktemp("zmq-hostile"), "--host", "localhost",
                        "--num-pages", "1024", "--api-key", API_KEY, "--zmq-port", str(zmq_port))
    srv.zmq_url = f"tcp://127.0.0.1:{zmq_port}"
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log_path.read_text()


@pytest.fixture(scope="module")
def raw(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.zmq_url)
    yield sock
    sock.close(linger=0)


def receive(sock: zmq.Socket, call_id: str, timeout_ms: int = 30_000) -> ZmqReply:
    """The next reply to ``call_id`` (or to an unreadable message, id ""); replies to calls
    abandoned earlier are skipped."""
    while True:
        assert sock.poll(timeout_ms), "the door did not answer"
        reply = reply_decoder.decode(sock.recv())
        if reply.id == call_id:
            return reply


def call_bytes(kind: str, call_id: str, api_key: str | None = API_KEY, **fields) -> bytes:
    return msgspec.msgpack.encode({"type": kind, "id": call_id, "api_key": api_key, **fields})


def assert_still_serves(server) -> None:
    with ZmqClient(server.zmq_url, timeout=60, api_key=API_KEY) as client:
        chunks = list(client.generate({"input_ids": [5, 6, 7],
                                       "sampling_params": {"max_tokens": 3}}))
    assert sum(len(c.token_ids) for chunk in chunks for c in chunk.choices) == 3
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.e2e
def test_the_door_binds_where_http_binds(server):
    # --host localhost: HTTP listens on 127.0.0.1 only, and so does ZMQ (not every interface).
    assert f"ZMQ at {server.zmq_url}" in server.ready_line


@pytest.mark.e2e
@pytest.mark.parametrize("frames", [
    [b"\x93not a call"],
    [b""],
    [b"a", b"b"],
    [b"", call_bytes("OpenSessionCall", "x")],  # a REQ-style empty delimiter first
    [b"1", b"2", b"3"],
    [b"1", b"2", b"3", b"4", b"5"],
    [DEEP],
    [b"\x84" + call_bytes("ChatCall", "deep")[1:]  # the call's map gets a 4th key, body:
     + b"\xa4body\x81\xa8messages\x91\x81\xa7content" + DEEP],
], ids=["garbage", "empty", "2 frames", "delimiter", "3 frames", "5 frames", "deep",
        "deep body"])
def test_malformed_messages_get_an_error_reply(server, raw, frames):
    raw.send_multipart(frames)
    reply = receive(raw, "")
    assert isinstance(reply, ErrorReply) and reply.status == 400
    assert reply.error.type == "invalid_request_error" and "Traceback" not in reply.error.message
    if len(frames) > 1:
        assert f"had {len(frames)}" in reply.error.message
    if len(frames[-1]) > len(DEEP):  # the deep value sits where the decoder recurses
        assert "nested too deeply" in reply.error.message
    assert_still_serves(server)


@pytest.mark.e2e
@pytest.mark.parametrize("api_key", [None, "", "sk-wrong", API_KEY + "x"])
def test_a_call_without_the_key_gets_401(server, raw, api_key):
    for kind, fields in [("GenerateCall", {"body": {"input_ids": [5, 6]}}),
                         ("OpenSessionCall", {}), ("AbortCall", {})]:
        call_id = uuid.uuid4().hex
        raw.send(call_bytes(kind, call_id, api_key, **fields))
        reply = receive(raw, call_id)
        assert isinstance(reply, ErrorReply) and reply.status == 401
        assert "API key" in reply.error.message
    with ZmqClient(server.zmq_url, timeout=30, api_key=api_key) as client:
        with pytest.raises(ZmqAPIError) as refused:
            list(client.completion({"prompt": "x", "max_tokens": 2}))
    assert refused.value.status == 401
    assert_still_serves(server)


# ------------------------------------------------------------------------------------ fuzz
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
_ids = st.lists(st.integers(-5, 2**32), max_size=4)
_sampling = {"temperature": st.floats(), "n": st.integers(0, 3), "top_k": st.integers(-2, 50),
             "cache_salt": st.text(max_size=4), "junk": _json}
_bodies = {  # near-valid bodies of each call: most decode, some fail validation
    "CompletionCall": st.fixed_dictionaries(
        {"prompt": st.text(max_size=16) | _ids, "max_tokens": st.integers(-1, 3)},
        optional=_sampling),
    "ChatCall": st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]),
                                                     "content": st.text(max_size=16) | _json}),
                              min_size=1, max_size=2),
         "max_tokens": st.integers(1, 3)}, optional=_sampling),
    "GenerateCall": st.fixed_dictionaries(
        {"input_ids": _ids, "sampling_params": st.fixed_dictionaries(
            {"max_tokens": st.integers(1, 3)}, optional={"n": st.integers(0, 3), "x": _json})},
        optional={"cache_salt": st.text(max_size=4), "junk": _json}),
}
_keys = st.sampled_from([API_KEY, API_KEY, None, "sk-wrong"])
_calls = st.one_of(
    *[st.builds(lambda kind, call_id, key, body: msgspec.msgpack.encode(
        {"type": kind, "id": call_id, "api_key": key, "body": body}),
        st.just(kind), st.text(max_size=6), _keys, body) for kind, body in _bodies.items()],
    st.builds(lambda kind, call_id, key, extra: msgspec.msgpack.encode(
        {"type": kind, "id": call_id, "api_key": key, **extra}),
        st.sampled_from(CALL_TYPES), st.text(max_size=6), _keys,
        st.dictionaries(st.sampled_from(["session_id", "body", "other"]), _json, max_size=2)))
_frames = st.one_of(
    _calls.map(lambda call: [call]),
    st.lists(st.binary(max_size=64) | _json.map(msgspec.msgpack.encode) | _calls,
             min_size=1, max_size=4))


def expected_end(frames: list[bytes]) -> tuple[str, int | None] | None:
    """(id, status) of the reply that ends what ``frames`` start (status None: Done or a
    session reply); None when nothing comes back (an authorised abort)."""
    if len(frames) != 1:
        return "", 400
    try:
        call = call_decoder.decode(frames[0])
    except (msgspec.MsgspecError, RecursionError):
        return "", 400
    if call.api_key != API_KEY:
        return call.id, 401
    return None if isinstance(call, AbortCall) else (call.id, None)


@pytest.mark.e2e
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=_frames)
def test_fuzzed_frames_get_an_answer_and_the_door_stays_up(server, raw, frames):
    raw.send_multipart(frames)
    end = expected_end(frames)
    if end is None:
        return
    call_id, status = end
    reply = receive(raw, call_id)
    while not isinstance(reply, ErrorReply | Done | SessionReply):
        reply = receive(raw, call_id)  # chunks of a valid call, up to its end
    if isinstance(reply, ErrorReply):
        assert status is None or reply.status == status
        assert "Traceback" not in reply.error.message
    else:
        assert status is None
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.e2e
def test_after_the_fuzz_the_door_and_http_still_serve(server):
    assert_still_serves(server)
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "still here", "max_tokens": 2})
    assert response.status_code == 200


# ----------------------------------------------------------------------- a dead receive loop
def test_a_receive_loop_that_dies_fails_health(monkeypatch):
    service = Service(ScriptedClient(), INFO, EngineConfig(model="/models/tiny"))
    client = TestClient(build_app(service))
    assert client.get("/health").status_code == 200

    async def broken() -> list[bytes]:
        raise zmq.ZMQError(zmq.ETERM, "the context was terminated")

    async def run_door() -> None:
        door = ZmqFrontend("tcp://127.0.0.1:0", service.options.max_request_bytes)
        monkeypatch.setattr(door.sock, "recv_multipart", broken)
        door.start(service)
        await asyncio.sleep(0.05)
        await door.stop()
        door.close()

    asyncio.run(run_door())
    health = client.get("/health")
    assert health.status_code == 503
    assert "the ZMQ door stopped receiving" in health.json()["error"]["message"]
