"""Every front door refuses a call without the server's API key, in process over a scripted
engine client: HTTP through the app, ZMQ through its ROUTER socket, gRPC through its key-check
interceptor. A missing key, a wrong one, the key with a character more, and (where a header
carries it) the right key under another scheme; the right key passes. The same doors on live
servers: tests/test_tenant_isolation.py, test_zmq_hostile.py, test_grpc_frontend.py (e2e)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.server.app import build_app
from engine.server.grpc_frontend import key_check, load_grpc
from engine.server.options import ServeOptions
from engine.server.pipeline import Pipeline
from engine.server.service import Service
from engine.server.zmq_frontend import ZmqFrontend
from engine.server.zmq_messages import Done, ErrorReply, reply_decoder
from tests.server_process import API_KEY
from tests.test_server_app import INFO, ScriptedClient

WRONG = [None, "sk-wrong", API_KEY + "x"]


def service() -> Service:
    return Service(ScriptedClient(), INFO, EngineConfig(model="/models/tiny"),
                   ServeOptions(api_key=API_KEY))


@pytest.mark.parametrize("header", [None, "Bearer sk-wrong", f"Bearer {API_KEY}x",
                                    f"Basic {API_KEY}", API_KEY])
def test_http_refuses_a_call_without_the_key(header):
    app = TestClient(build_app(service()))
    headers = {} if header is None else {"Authorization": header}
    body = {"input_ids": [5, 6], "sampling_params": {"max_tokens": 3}}
    refused = app.post("/generate", json=body, headers=headers)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert app.post("/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
                    ).status_code == 200


def test_zmq_refuses_a_call_without_the_key(tmp_path):
    async def answers() -> list[object]:
        door = ZmqFrontend(f"ipc://{tmp_path}/door", 1 << 20)
        door.start(service())
        client = door.ctx.socket(zmq.DEALER)
        client.connect(door.address)
        replies = []
        try:
            for key in [*WRONG, API_KEY]:
                call = {"type": "GenerateCall", "id": f"call-{key}", "api_key": key,
                        "body": {"input_ids": [5, 6], "sampling_params": {"max_tokens": 3}}}
                await client.send(msgspec.msgpack.encode(call))
                while True:  # the right key's chunks, then Done
                    reply = reply_decoder.decode(await asyncio.wait_for(client.recv(), 30))
                    if isinstance(reply, ErrorReply | Done):
                        replies.append(reply)
                        break
        finally:
            client.close(linger=0)
            await door.stop()
            door.close()
        return replies

    *refused, served = asyncio.run(answers())
    assert [(r.status, "API key" in r.error.message) for r in refused] == [(401, True)] * 3
    assert isinstance(served, Done)


def test_grpc_refuses_a_call_without_the_key():
    grpc = load_grpc()[0]
    interceptor = key_check(grpc, Pipeline(service()))

    async def method(request: object, context: object) -> str:
        return "served"

    handler = grpc.unary_unary_rpc_method_handler(method)

    class Context:
        async def abort(self, code: object, message: str) -> None:
            self.code, self.message = code, message
            raise RuntimeError("aborted")

    async def call(metadata: tuple) -> tuple[object, str]:
        async def continuation(details: object) -> object:
            return handler

        details = SimpleNamespace(method="/vllm.grpc.engine.VllmEngine/Generate",
                                  invocation_metadata=metadata)
        chosen = await interceptor.intercept_service(continuation, details)
        context = Context()
        try:
            return "answered", await chosen.unary_unary(None, context)
        except RuntimeError:
            return context.code, context.message

    for header in [*(None if k is None else f"Bearer {k}" for k in WRONG), f"Basic {API_KEY}"]:
        metadata = () if header is None else (("authorization", header),)
        code, message = asyncio.run(call(metadata))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in message, header
    assert asyncio.run(call((("authorization", f"Bearer {API_KEY}"),))) == ("answered",
                                                                           "served")
