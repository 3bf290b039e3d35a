"""The gRPC front door (``radixserve serve --grpc-port``) driven by smg-grpc-proto's own client
stub: Generate equal to /generate, the information RPCs, GetTokenizer, errors,
SubscribeKvEvents; then smg itself (``smg launch --policy cache_aware`` from SMG_VENV, default
/work/smg-venv) routing over two servers by their KV events, and loading the tokenizer from a
server whose model directory it cannot read."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.server_process import AUTH, ServerProcess, free_port, metric_values

grpc = pytest.importorskip("grpc", reason="the grpc extra is not installed")
pytest.importorskip("smg_grpc_proto", reason="the grpc extra is not installed")
from smg_grpc_proto.generated import common_pb2  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc  # noqa: E402

SMG = Path(os.environ.get("SMG_VENV", "/work/smg-venv")) / "bin" / "smg"
API_KEY = AUTH["Authorization"][7:]


def with_key(channel: grpc.Channel, key: str) -> grpc.Channel:
    """``channel`` sending ``authorization: Bearer key`` metadata on every call."""

    class AddKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _with_key(self, details):
            metadata = [*(details.metadata or ()), ("authorization", f"Bearer {key}")]
            return details._replace(metadata=metadata)

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._with_key(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._with_key(details), request)

    return grpc.intercept_channel(channel, AddKey())


class Door:
    """A server with --grpc-port and a stub on it."""

    def __init__(self, tmp: Path, *args: str, key: str | None = API_KEY) -> None:
        self.grpc_port = free_port()
        self.server = ServerProcess(tmp, *(("--api-key", key) if key else ()),
                                    "--grpc-port", str(self.grpc_port), *args)
        self.bare = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")  # sends no key
        self.channel = with_key(self.bare, key) if key else self.bare
        self.stub = pb_grpc.VllmEngineStub(self.channel)

    def generate(self, ids: list[int], stream: bool = True, **params) -> list:
        request = pb.GenerateRequest(
            request_id=f"t-{time.monotonic_ns()}", stream=stream,
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=pb.SamplingParams(**params))
        return list(self.stub.Generate(request, timeout=60))

    def http_generate(self, ids: list[int], **params) -> dict:
        body = {"input_ids": ids, "sampling_params": params}
        return httpx.post(f"{self.server.url}/generate", json=body, headers=AUTH,
                          timeout=60).json()

    def cached_tokens(self) -> float:
        return metric_values(self.server).get("radixserve_cached_prompt_tokens_total", 0.0)

    def stop(self) -> None:
        self.bare.close()
        assert self.server.stop() == 0


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    d = Door(tmp_path_factory.mktemp("grpc"))
    yield d
    d.stop()


PROMPT = [(7 * i + 3) % 3000 + 10 for i in range(40)]


@pytest.mark.e2e
@pytest.mark.parametrize("key", [None, "wrong-key", API_KEY + "x"])
def test_calls_without_the_key_are_refused_and_reach_nothing(door, key):
    """Every RPC (unary, server-streaming) needs the server's --api-key as
    ``authorization: Bearer`` metadata; without it the call is UNAUTHENTICATED and no engine
    request is made."""
    channel = door.bare if key is None else with_key(door.bare, key)
    stub = pb_grpc.VllmEngineStub(channel)
    before = metric_values(door.server).get("radixserve_prompt_tokens_total", 0.0)
    request = pb.GenerateRequest(request_id="no-key", stream=True,
                                 tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                 sampling_params=pb.SamplingParams(max_tokens=4))
    calls = [lambda: list(stub.Generate(request, timeout=30)),
             lambda: stub.HealthCheck(pb.HealthCheckRequest(), timeout=10),
             lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
             lambda: list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10)),
             lambda: stub.Abort(pb.AbortRequest(request_ids=["x"]), timeout=10)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key is required" in refused.value.details()
        assert "authorization: Bearer" in refused.value.details()
    assert metric_values(door.server).get("radixserve_prompt_tokens_total", 0.0) == before
    # The right key, on the same server, is served.
    assert door.stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy


@pytest.mark.e2e
def test_generate_streams_the_tokens_http_generates(door):
    expected = door.http_generate(PROMPT, temperature=0, max_tokens=8)["choices"][0]
    replies = door.generate(PROMPT, temperature=0, max_tokens=8)
    chunks = [r.chunk for r in replies if r.WhichOneof("response") == "chunk"]
    complete = replies[-1].complete
    assert [t for c in chunks for t in c.token_ids] == expected["token_ids"]
    assert complete.finish_reason == expected["finish_reason"] == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (40, 8)
    assert complete.cached_tokens > 0  # the same prompt ran just before, over HTTP
    # Not streaming: one complete message with every output token.
    [whole] = door.generate(PROMPT, stream=False, temperature=0, max_tokens=8)
    assert list(whole.complete.output_ids) == expected["token_ids"]


@pytest.mark.e2e
def test_logprobs_carry_the_top_alternatives_by_id(door):
    """smg's ``logprobs`` = N (vLLM's meaning): each output token's logprob and its N most
    likely alternatives, the same as /generate's, streamed or whole."""
    expected = door.http_generate(PROMPT, temperature=0, max_tokens=4, logprobs=2)
    expected = expected["choices"][0]
    for stream in (True, False):
        replies = door.generate(PROMPT, stream=stream, temperature=0, max_tokens=4, logprobs=2)
        if stream:
            parts = [r.chunk.output_logprobs for r in replies if r.WhichOneof("response") == "chunk"]
        else:
            parts = [replies[-1].complete.output_logprobs]
        ids = [t for p in parts for t in p.token_ids]
        tops = [top for p in parts for top in p.top_logprobs]
        assert ids == expected["token_ids"]
        # A cached prefix runs other kernels than a cold prompt: the last digits may differ.
        assert [v for p in parts for v in p.token_logprobs] == pytest.approx(
            expected["logprobs"], abs=1e-3)
        assert [list(top.token_ids) for top in tops] == [
            [t["token_id"] for t in top] for top in expected["top_logprobs"]]
        assert all(top.token_ids[0] == token for top, token in zip(tops, ids, strict=True))
        assert [list(top.values) for top in tops] == [
            pytest.approx([t["logprob"] for t in top], abs=1e-3) for top in expected["top_logprobs"]]


@pytest.mark.e2e
def test_health_model_server_info_and_loads(door):
    assert door.stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    info = door.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name == "radixserve-demo"
    assert Path(info.model_path, "tokenizer.json").is_file()  # smg can load the tokenizer
    assert info.vocab_size > 0 and info.max_context_length > 0 and info.eos_token_ids
    server = door.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server.block_size == 16 and server.data_parallel_size == 1
    loads = door.stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1
    assert loads.loads[0].max_total_num_tokens > 0


@pytest.mark.e2e
def test_get_tokenizer_sends_the_model_directorys_tokenizer(door, tmp_path):
    from transformers import AutoTokenizer

    chunks = list(door.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert len(chunks) >= 2  # the demo bundle spans chunks: smg below joins them too
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert not any(c.sha256 for c in chunks[:-1])
    model_dir = Path(door.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_path)
    with zipfile.ZipFile(io.BytesIO(data)) as bundle:
        names = bundle.namelist()
        bundle.extractall(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert all((tmp_path / n).read_bytes() == (model_dir / n).read_bytes() for n in names)
    # The bundle alone is the model's tokenizer.
    text = "def bundle(x):\n    return x + 1  # héllo"
    assert (AutoTokenizer.from_pretrained(tmp_path).encode(text)
            == AutoTokenizer.from_pretrained(model_dir).encode(text))
    again = list(door.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    assert b"".join(c.data for c in again) == data  # the same files, the same fingerprint


def test_tokenizer_bundle_chunks_and_refusal(tmp_path):
    from engine.server.grpc_frontend import bundle_chunks, tokenizer_bundle

    data = bytes(range(256)) * 10
    chunks = bundle_chunks(data, "digest", 1000)
    assert [len(c) for c, _ in chunks] == [1000, 1000, 560]
    assert [d for _, d in chunks] == ["", "", "digest"]
    assert bundle_chunks(data, "d", len(data)) == [(data, "d")]
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        tokenizer_bundle(str(tmp_path))


@pytest.mark.e2e
@pytest.mark.parametrize("params, words", [
    ({"json_schema": "{}"}, "json_schema"),
    ({"min_tokens": 3}, "min_tokens"),
])
def test_unsupported_parameters_are_refused(door, params, words):
    with pytest.raises(grpc.RpcError) as info:
        door.generate(PROMPT, max_tokens=2, **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


@pytest.mark.e2e
def test_out_of_vocabulary_ids_are_invalid(door):
    with pytest.raises(grpc.RpcError) as info:
        door.generate([10, 999_999], max_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token ids must be in" in info.value.details()


@pytest.mark.e2e
def test_kv_events_carry_the_stored_blocks(door):
    prompt = [(11 * i + 5) % 3000 + 20 for i in range(50)]
    door.generate(prompt, temperature=0, max_tokens=2)
    # The relay keeps what the engine published since it started: a late subscriber sees it.
    stream = door.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=5)
    blocks, parents, seqs = {}, [], []
    try:
        for batch in stream:
            if batch.load.load_only:  # a heartbeat: no events, the last sequence again
                assert not batch.events and batch.sequence_number == seqs[-1]
                continue
            seqs.append(batch.sequence_number)
            for event in batch.events:
                if event.WhichOneof("data") == "stored":
                    stored = event.stored
                    parents.append(stored.parent_block_hash
                                   if stored.HasField("parent_block_hash") else None)
                    for block in stored.blocks:
                        assert block.block_size == 16
                        blocks[block.block_hash] = list(block.token_ids)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # live: it never ends by itself
    assert seqs == list(range(len(seqs))) and seqs
    for k in range(3):  # the prompt's three whole blocks
        assert prompt[16 * k:16 * k + 16] in blocks.values()
    assert all(p is None or p in blocks for p in parents)


def test_bad_configurations_are_refused(tmp_path):
    from engine.cli import build_parser
    from engine.commands.options import config_from_args
    from engine.commands.serve import _grpc_refusal

    def refusal(*flags: str) -> str | None:
        args = build_parser().parse_args(["serve", "--model", "demo", *flags])
        return _grpc_refusal(config_from_args(args))

    assert "--dp-size > 1" in refusal("--dp-size", "2")
    assert "must be an address this server binds" in refusal(
        "--kv-events-endpoint", "tcp://gateway:5557")
    assert refusal("--kv-events-endpoint", "tcp://*:5557") is None


def test_missing_extra_is_a_sentence(monkeypatch):
    from engine.server.grpc_frontend import load_grpc

    monkeypatch.setitem(sys.modules, "grpc", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[grpc\]' in the radixserve checkout"):
        load_grpc()


# ------------------------------------------------------------------------------------- smg
class Smg:
    """``smg launch --policy cache_aware`` over gRPC workers, on free ports."""

    def __init__(self, tmp: Path, model_path: str | None, worker_urls: list[str]) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "smg.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(SMG), "launch", "--policy", "cache_aware", "--host", "127.0.0.1",
             "--port", str(self.port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(self.metrics_port),
             *(["--model-path", model_path] if model_path else []),
             "--worker-urls", *worker_urls], stdout=self.log, stderr=subprocess.STDOUT)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            match = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
            if match and all(f'{k}="{v}"' in (match.group(1) or "")
                             for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def wait_for(self, what: str, ready, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"smg: {what} did not happen:\n{self.log_path.read_text()[-4000:]}")

    def complete(self, prompt: str, model: str = "radixserve-demo") -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.mark.e2e
@pytest.mark.skipif(not SMG.exists(), reason=f"smg is not installed at {SMG} (set SMG_VENV)")
def test_smg_routes_by_the_engines_kv_events(tmp_path):
    """A prefix cached on one server behind smg's back (a direct HTTP request smg never saw)
    draws smg's later requests with that prefix to that server: smg learned it only from the
    server's KV events. smg's metrics name the branch (event_hit), the events applied, and the
    worker each request went to; the servers' own counters show the cache hits."""
    # smg 1.13 sends no credentials over gRPC, so its workers run without --api-key.
    doors = [Door(tmp_path / name, key=None) for name in ("a", "b")
             if (tmp_path / name).mkdir() is None]
    smg = None
    try:
        model_path = doors[0].stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_path
        urls = [f"grpc://127.0.0.1:{d.grpc_port}" for d in doors]
        smg = Smg(tmp_path, model_path, urls)
        smg.wait_for("both KV event streams connected", lambda: all(
            smg.value("smg_kv_event_subscriptions_total", worker=u) >= 1 for u in urls))
        prefix = "def shared_prefix(alpha, beta):\n    " + "total = alpha * beta + 1\n    " * 12
        for k, (door, url) in enumerate(zip(doors, urls, strict=True)):
            # Cached on this server only, by a request that does not pass through smg.
            httpx.post(f"{door.server.url}/v1/completions", headers=AUTH, timeout=60, json={
                "model": "radixserve-demo", "prompt": f"# {k}\n{prefix}", "max_tokens": 1})
            smg.wait_for(f"{url}'s stored blocks applied", lambda url=url: smg.value(
                "smg_kv_event_blocks_total", worker=url, op="stored") >= 7)  # 124 tokens
        before = [d.cached_tokens() for d in doors]
        for k, url in enumerate(urls):
            for suffix in ("x = 1", "y = 2", "z = 3"):
                sent = smg.value("smg_worker_requests_total", worker=url)
                usage = smg.complete(f"# {k}\n{prefix}{suffix}")["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 112
                assert smg.value("smg_worker_requests_total", worker=url) == sent + 1
        after = [d.cached_tokens() for d in doors]
        assert all(a - b >= 3 * 112 for a, b in zip(after, before, strict=True))  # each served its own
        assert smg.value("smg_cache_aware_policy_branch_total", branch="event_hit") == 6
    finally:
        for door in doors:
            door.stop()
        if smg is not None:
            smg.stop()


@pytest.mark.e2e
@pytest.mark.skipif(not SMG.exists(), reason=f"smg is not installed at {SMG} (set SMG_VENV)")
def test_smg_loads_the_tokenizer_through_get_tokenizer(tmp_path):
    """A gateway on another machine cannot read the model_path a worker reports; smg then asks
    the worker (GetTokenizer). Here the model directory is moved away once the server has
    started, and smg, given no --model-path, serves text completions with the bundle: the
    same text and token counts as the server answers directly."""
    from engine.checkpoints.demo_model import build_demo_model

    model_dir = tmp_path / "served"
    shutil.copytree(build_demo_model(), model_dir)
    door = Door(tmp_path, "--model", str(model_dir), key=None)
    smg = None
    try:
        model_dir.rename(tmp_path / "gone")
        smg = Smg(tmp_path, None, [f"grpc://127.0.0.1:{door.grpc_port}"])
        smg.wait_for("the tokenizer loaded from the worker", lambda: "Tokenizer extracted"
                     in smg.log_path.read_text(errors="replace"))
        prompt = "def bundle(x):\n    return"
        smg.wait_for("a text completion", lambda: httpx.post(
            f"{smg.url}/v1/completions", timeout=60,
            json={"model": "served", "prompt": prompt, "max_tokens": 1}).status_code == 200)
        through_smg = smg.complete(prompt, model="served")
        direct = httpx.post(f"{door.server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "served", "prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
        assert through_smg["choices"][0]["text"] == direct["choices"][0]["text"]
        assert through_smg["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    finally:
        door.stop()
        if smg is not None:
            smg.stop()
