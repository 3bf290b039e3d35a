"""``/tokenize`` and ``/detokenize`` in process: the HTTP door over a ``TokenizerWorker`` with
the demo model's tokenizer (messages encoded as they cross the process boundary), checked
against the functions the completion and chat paths tokenize with."""

from __future__ import annotations

import msgspec
import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import (
    DetokenizeRequest,
    SchedulerStats,
    TokenizeRequest,
    TokenizerReply,
    decode,
    encode,
)
from engine.server.app import build_app
from engine.server.service import Service
from tests.test_server_app import INFO
from tokenizer_worker.core import TokenizerWorker
from tokenizer_worker.template import encode_prompt, render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


class TokenizerClient:
    """Stands in for EngineClient: tokenize calls go to a real TokenizerWorker."""

    def __init__(self, worker: TokenizerWorker) -> None:
        self.worker = worker
        self.stats = SchedulerStats()
        self.dead: str | None = None
        self.num_pending = 0

    async def tokenize(self, msg: TokenizeRequest | DetokenizeRequest) -> TokenizerReply:
        reply = self.worker.on_tokenize(decode(encode(msg)))
        return decode(encode(reply))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(build_demo_model()))


@pytest.fixture(scope="module")
def client(tokenizer) -> TestClient:
    info = msgspec.structs.replace(INFO, vocab_size=len(tokenizer))
    service = Service(TokenizerClient(TokenizerWorker(tokenizer, 0, context_len=64)), info,
                      EngineConfig(model="/models/tiny"))
    return TestClient(build_app(service))


def test_a_prompt_is_tokenized_as_a_completion_and_comes_back(client, tokenizer):
    text = "Hello, radix world!"
    body = client.post("/tokenize", json={"prompt": text}).json()
    assert body == {"tokens": encode_prompt(tokenizer, text), "count": len(body["tokens"]),
                    "max_model_len": 64, "token_strs": None}
    plain = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = client.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


def test_messages_are_tokenized_as_a_chat_request(client, tokenizer):
    body = client.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert body["tokens"] == render_chat(tokenizer, MESSAGES)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    bare = client.post("/tokenize", json={"messages": MESSAGES,
                                          "add_generation_prompt": False}).json()
    assert bare["tokens"] == render_chat(tokenizer, MESSAGES, add_generation_prompt=False)
    assert bare["count"] < body["count"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "return_tokens": True}, "return_tokens"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**12]}, "tokens"),
    ("/detokenize", {"tokens": "1"}, "tokens"),
])
def test_bad_fields_are_400s_naming_them(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404(client):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        response = client.post(path, json={**body, "model": "nope"})
        assert response.status_code == 404
        assert response.json()["error"]["param"] == "model"


def test_openapi_documents_both_routes(client):
    spec = client.get("/openapi.json").json()
    assert spec["paths"]["/tokenize"]["post"]["requestBody"]
    assert "return_token_strs" in spec["components"]["schemas"]["TokenizeBody"]["properties"]
    assert spec["components"]["schemas"]["DetokenizeBody"]["required"] == ["tokens"]
