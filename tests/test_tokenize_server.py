"""``/tokenize`` and ``/detokenize`` on a real demo-model server: ids as a chat completion
counts them, a round trip back to the text, and the door's refusals (key, body size, fields,
vocabulary, model)."""

from __future__ import annotations

import httpx
import pytest

from tests.server_process import API_KEY, AUTH, serve_module

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a radix tree?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("tokenize"), "--api-key", API_KEY,
                            "--max-request-bytes", "4096")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def test_a_text_comes_back_from_its_ids(http, model):
    text = "The quick brown fox jumps over the lazy dog."
    body = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                        "model": model, "return_token_strs": True}).json()
    assert body["count"] == len(body["tokens"]) > 0
    assert len(body["token_strs"]) == body["count"]
    assert all(isinstance(s, str) for s in body["token_strs"])
    cards = http.get("/v1/models").json()["data"]
    assert body["max_model_len"] == cards[0]["max_model_len"]
    back = http.post("/detokenize", json={"tokens": body["tokens"], "model": model}).json()
    assert back == {"prompt": text}


def test_messages_count_as_a_chat_completion_reports(http, oai, model):
    body = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["token_strs"] is None
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                       temperature=0)
    assert body["count"] == chat.usage.prompt_tokens


def test_a_prompt_counts_as_a_completion_reports(http, oai, model):
    text = "Once upon a time"
    body = http.post("/tokenize", json={"prompt": text}).json()
    completion = oai.completions.create(model=model, prompt=text, max_tokens=1, temperature=0)
    assert body["count"] == completion.usage.prompt_tokens


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_key_is_required(server, path):
    response = httpx.post(f"{server.url}{path}", json={"prompt": "x"}, timeout=30)
    assert response.status_code == 401


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "continue": True}, "continue"),
    ("/detokenize", {"tokens": [1, 10_000_000]}, "tokens"),
    ("/detokenize", {"tokens": [-5]}, "tokens"),
])
def test_bad_fields_are_400s_naming_them(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404(http):
    response = http.post("/tokenize", json={"prompt": "x", "model": "no-such-model"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_an_oversize_body_is_a_413(http):
    assert http.post("/tokenize", json={"prompt": "x" * 5000}).status_code == 413
