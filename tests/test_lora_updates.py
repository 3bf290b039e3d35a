"""Runtime LoRA updates across data-parallel replicas (tokenizer_worker/lora_updates.py): one
answer once every live replica has answered, a load some replicas refused taken back from
those that took it, and a replica that stops no longer waited for; and through a
``--dp-size 2`` server, a load over HTTP that every replica serves with the adapter's weights."""

from __future__ import annotations

import concurrent.futures
import importlib.util

import pytest

from engine.contracts.lora import LoraAdapterInfo
from engine.contracts.protocol import LoraUpdate, LoraUpdated
from tokenizer_worker.lora_updates import UNDO, LoraFanOut

LOAD = LoraUpdate(rid="u1", name="gamma", path="/adapters/gamma", reply_to=1)


def took(rid: str = "u1") -> LoraUpdated:
    adapter = LoraAdapterInfo(name="gamma", lora_id=3, rank=4, content_hash="0123456789abcdef")
    return LoraUpdated(rid=rid, reply_to=1, adapter=adapter, adapters=[adapter])


def refused(rid: str = "u1") -> LoraUpdated:
    return LoraUpdated(rid=rid, reply_to=1, status=400, error="rank 64 is over --max-lora-rank")


def test_one_answer_once_every_replica_has_answered():
    fan = LoraFanOut()
    assert fan.start(LOAD, [0, 1]) is None
    assert fan.answer(0, took()) == (None, [])
    answer, undo = fan.answer(1, took())
    assert answer == took() and undo == []
    assert fan.pending == {}
    assert fan.answer(1, took()) == (None, [])  # a late duplicate is ignored


def test_a_load_some_replicas_refused_is_taken_back_where_it_was_taken():
    fan = LoraFanOut()
    fan.start(LOAD, [0, 1, 2])
    fan.answer(0, took())
    fan.answer(1, refused())
    answer, undo = fan.answer(2, took())
    assert answer == refused()
    assert [(r, u.name, u.path, u.rid) for r, u in undo] == [
        (0, "gamma", None, "u1" + UNDO), (2, "gamma", None, "u1" + UNDO)]
    assert fan.answer(0, took("u1" + UNDO)) == (None, [])  # nobody waits for the rollback


def test_a_refused_unload_takes_nothing_back():
    fan = LoraFanOut()
    fan.start(LoraUpdate(rid="u2", name="gamma", reply_to=1), [0, 1])
    fan.answer(0, took("u2"))
    answer, undo = fan.answer(1, refused("u2"))
    assert answer.error is not None and undo == []


def test_a_replica_that_stops_is_not_waited_for():
    fan = LoraFanOut()
    fan.start(LOAD, [0, 1])
    fan.answer(0, took())
    [(answer, undo)] = fan.replica_down(1)
    assert answer == took() and undo == []
    fan.start(LOAD, [0, 1])
    assert fan.replica_down(0) == [(None, [])]
    [(answer, _)] = fan.replica_down(1)
    assert answer.status == 503 and "stopped before it answered" in answer.error
    assert fan.pending == {}


def test_with_no_live_replica_the_answer_is_at_once():
    answer = LoraFanOut().start(LOAD, [])
    assert answer.status == 503 and answer.rid == "u1" and answer.reply_to == 1


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_a_dp2_server_loads_an_adapter_on_every_replica(tmp_path):
    """An adapter loaded over HTTP on a --dp-size 2 server answers with its weights on both
    replicas (requests spread by load reach each), and its unload reaches both (then a 404)."""
    import httpx

    from engine.checkpoints.demo_model import build_demo_model
    from tests.lora_fixtures import ADAPTERS, make_adapter, peft_model
    from tests.server_process import API_KEY, AUTH, ServerProcess
    from tests.test_dp_server import wait_for_metric
    from tests.test_scheduler import hf_greedy

    model_dir = str(build_demo_model())
    path = str(make_adapter(model_dir, tmp_path / "beta", 1, **ADAPTERS["beta"]))
    server = ServerProcess(tmp_path, "--api-key", API_KEY, "--dp-size", "2", "--num-pages",
                           "256", "--enable-lora", "--enable-runtime-lora-updating")
    prompts = [list(range(40 + 7 * i, 70 + 7 * i)) for i in range(4)]
    body = {"sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
            loaded = client.post("/v1/load_lora_adapter",
                                 json={"lora_name": "gamma", "lora_path": path})
            assert loaded.status_code == 200, loaded.text
            models = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert "gamma" in models
            def generate(prompt: list[int]) -> list[int]:
                response = client.post("/generate", json={**body, "input_ids": prompt,
                                                          "model": "gamma"})
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["token_ids"]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:  # in flight together
                got = list(pool.map(generate, prompts))
            routed = wait_for_metric(server, "requests_routed_total", lambda v: sum(v) >= 4)
            unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
            assert unloaded.status_code == 200, unloaded.text
            gone = client.post("/generate", json={**body, "input_ids": prompts[0],
                                                  "model": "gamma"})
            assert gone.status_code == 404, gone.text
    finally:
        assert server.stop() == 0
    oracle = peft_model(model_dir, path)
    assert got == [hf_greedy(oracle, prompt, 8) for prompt in prompts]
    assert sum(routed) == 4 and min(routed) >= 1  # both replicas served the adapter
