"""LoRA adapters through a live server: ``--enable-lora --lora-modules``, the request's
``model`` choosing the adapter, ``/v1/models`` listing each adapter with its parent, a 404 for
an unknown one, the base model's cache no hit for an adapter, and vLLM's load and unload
endpoints."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from engine.checkpoints.demo_model import build_demo_model
from tests.lora_fixtures import make_adapters, peft_model
from tests.server_process import API_KEY, AUTH, metric_values, serve_module
from tests.test_scheduler import hf_greedy

# peft looked up, not imported: every test process collects this module, and the import takes
# about a second
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                                 reason="peft is not installed")]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root, model_dir = tmp_path_factory.mktemp("adapters"), str(build_demo_model())
    return make_adapters(model_dir, root)


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    yield from serve_module(tmp_path_factory.mktemp("server"), "--api-key", API_KEY,
                            "--num-pages", "512", "--enable-lora",
                            "--enable-runtime-lora-updating", "--lora-modules",
                            *(f"{name}={path}" for name, path in adapters.items()))


def generate(client: httpx.Client, model: str | None, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True}}
    if model is not None:
        body["model"] = model
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_list_each_adapter_with_its_parent(server):
    cards = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    base = cards[0]["id"]
    assert [(c["id"], c["parent"]) for c in cards] == [
        (base, None), ("alpha", base), ("beta", base)]


def test_the_model_field_chooses_the_adapter(server, adapters):
    model_dir = str(build_demo_model())
    prompt = list(range(40, 75))
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        base = generate(client, None, prompt)
        for name, path in adapters.items():
            answer = generate(client, name, prompt)
            assert answer["model"] == name
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            expected = hf_greedy(peft_model(model_dir, path), prompt, 8)
            assert answer["choices"][0]["token_ids"] == expected, name
            assert expected != base["choices"][0]["token_ids"]
        again = generate(client, None, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        assert again["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]
        unknown = client.post("/generate", json={"input_ids": prompt, "model": "gamma"})
        assert unknown.status_code == 404
        assert "'gamma' does not exist" in unknown.json()["error"]["message"]
    metrics = metric_values(server)
    for name in adapters:
        assert metrics[f"radixserve_lora_requests_total{{adapter={name},status=200}}"] >= 1
        assert metrics[f"radixserve_lora_prompt_tokens_total{{adapter={name}}}"] >= len(prompt)
        assert metrics[f"radixserve_lora_generation_tokens_total{{adapter={name}}}"] >= 8


def test_adapters_load_and_unload_at_runtime(server, adapters):
    body = {"lora_name": "gamma", "lora_path": adapters["alpha"]}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 401
        loaded = client.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'gamma' added successfully."
        assert "gamma" in [c["id"] for c in client.get("/v1/models").json()["data"]]
        prompt = list(range(80, 100))
        # the same files under another name: the same answers, its own cache
        assert generate(client, "gamma", prompt)["choices"][0]["token_ids"] == generate(
            client, "alpha", prompt)["choices"][0]["token_ids"]
        again = client.post("/v1/load_lora_adapter", json=body)
        assert again.status_code == 400 and "already loaded" in again.text
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "delta",
                                                         "lora_path": "/nowhere"})
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert gone.text == "Success: LoRA adapter 'gamma' removed successfully."
        assert client.post("/generate", json={"input_ids": prompt, "model": "gamma"}
                           ).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}
                           ).status_code == 404
        paths = client.get("/openapi.json").json()["paths"]
        body_schema = paths["/v1/load_lora_adapter"]["post"]["requestBody"]["content"]
        assert body_schema["application/json"]["schema"]["$ref"].endswith("LoadLoraAdapterBody")
