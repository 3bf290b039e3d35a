"""The gRPC front door (``radixserve serve --grpc-port``): smg's worker service, so the SGLang
model gateway (``smg launch --worker-urls grpc://HOST:PORT``) tokenizes requests itself, sends
token ids here and routes by this engine's KV events.

The service is ``vllm.grpc.engine.VllmEngine`` from ``smg-grpc-proto`` (the optional ``grpc``
extra); smg finds it by calling each runtime's HealthCheck and taking the one that answers.
What each RPC is served from:

    Generate           Service.generate_call / generate_stream: the /generate path, token ids in
                       (or text), token ids streamed out, usage and finish reason at the end
    HealthCheck        Service.unhealthy() (the same answer as /health)
    Abort              cancels the named Generate streams, which aborts their engine requests
    GetModelInfo       the ModelInfo the engine reported at start
    GetServerInfo      requests in flight, uptime, block_size (the KV events' block size)
    GetLoads           the scheduler's latest SchedulerStats (what /metrics reads)
    SubscribeKvEvents  the engine's KV events through ``KvEventRelay`` (engine/server/kv_relay.py)
    GetTokenizer       the model directory's tokenizer files as one zip (``tokenizer_bundle``),
                       streamed in 32 KiB chunks, its SHA-256 on the last: how smg loads the
                       tokenizer when the model_path this worker reports is not on its machine

The other RPCs (Embed, FlushCache, profiling) answer UNIMPLEMENTED. smg's request ids are its
own; the engine gives each request a fresh one, as it does for HTTP.

Every RPC passes the door pipeline's key check first (engine/server/pipeline.py): with
``--api-key K`` a call needs ``authorization: Bearer K`` metadata, or it is refused with
UNAUTHENTICATED before any servicer method runs (``KeyCheck``, a server interceptor). Generate
is validated, limited and answered through the same pipeline as HTTP's /generate. smg 1.13
sends no credentials on its gRPC calls (its ``--api-key`` is for HTTP workers), so a gRPC door
behind smg runs without ``--api-key``, on an address only the gateway reaches.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import time
import zipfile
from contextlib import aclosing
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.server.errors import APIError
from engine.server.kv_relay import KvEventRelay
from engine.server.net import host_port
from engine.server.pipeline import DOOR_STOP_GRACE, Pipeline
from engine.server.schemas import GenerateBody, TopToken
from engine.server.service import Service

logger = logging.getLogger("radixserve.grpc")
HEARTBEAT_SECONDS = 1.0
INSTALL_HINT = "pip install -e '.[grpc]' in the radixserve checkout (grpcio and smg-grpc-proto)"

# What a tokenizer needs from a model directory, in the layouts transformers and smg read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
                   "config.json")
# GetTokenizer's message size: small gRPC messages (SmolLM2's 645 KB bundle is 20 of them; the
# demo model's 46 KB bundle 2, so its tests cover joining chunks).
TOKENIZER_CHUNK_BYTES = 32 << 10

# HTTP status of an APIError -> the gRPC status code smg maps back to an HTTP error.
_STATUS_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND",
                 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


def load_grpc() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """grpc and smg-grpc-proto's modules, or an ImportError saying how to install them."""
    try:
        import grpc
        from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
    except ImportError as exc:
        raise ImportError(f"--grpc-port needs grpcio and smg-grpc-proto, which are not "
                          f"installed ({exc}); install them with {INSTALL_HINT}") from None
    return grpc, common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc


def sampling_values(params: Any) -> dict[str, Any]:
    """smg's SamplingParams proto as /generate's ``sampling_params``; unset proto3 scalars (0,
    empty) leave radixserve's defaults. Raises APIError 400 for what radixserve does not do."""
    which = params.WhichOneof("constraint")
    unsupported = [name for name, given in (
        (which or "", which is not None), ("min_tokens", params.min_tokens > 0),
        ("logit_bias", bool(params.logit_bias)),
        ("prompt_logprobs", params.HasField("prompt_logprobs")),
        ("truncate_prompt_tokens", params.HasField("truncate_prompt_tokens")),
        ("logprobs", params.HasField("logprobs") and params.logprobs < 0)) if given]
    if unsupported:
        raise APIError(400, f"radixserve does not support the sampling parameter "
                       f"{unsupported[0]!r} over gRPC", param=unsupported[0])
    values: dict[str, Any] = {}
    for name in ("temperature", "max_tokens", "seed", "logprobs"):
        if params.HasField(name):
            values[name] = getattr(params, name)
    for name in ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "n", "ignore_eos"):
        if getattr(params, name):
            values[name] = getattr(params, name)
    if params.stop:
        values["stop"] = list(params.stop)
    if params.stop_token_ids:
        values["stop_token_ids"] = list(params.stop_token_ids)
    return values


@cache
def tokenizer_bundle(model_dir: str) -> tuple[bytes, str]:
    """The tokenizer files of ``model_dir`` as a zip (files at its root, fixed timestamps, so
    the same files give the same bytes) and its SHA-256 hex digest. Raises FileNotFoundError
    when the directory holds no tokenizer.json, tokenizer.model or vocab.json."""
    files = [Path(model_dir, name) for name in TOKENIZER_FILES if Path(model_dir, name).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
        raise FileNotFoundError(f"{model_dir} holds no tokenizer file to send")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for path in files:
            entry = zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.compress_type = zipfile.ZIP_DEFLATED
            bundle.writestr(entry, path.read_bytes())
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def bundle_chunks(data: bytes, digest: str, size: int) -> list[tuple[bytes, str]]:
    """GetTokenizer's messages: ``data`` in pieces of ``size`` bytes, the digest on the last
    piece only (smg's contract: concatenate every chunk, check the final one's SHA-256)."""
    starts = range(0, len(data), size)
    return [(data[s : s + size], digest if s + size >= len(data) else "") for s in starts]


class VllmEngineDoor:
    """The servicer's methods; ``GrpcFrontend`` joins them with the generated base class (whose
    defaults answer UNIMPLEMENTED), which exists only once grpc is imported."""

    def __init__(self, service: Service, relay: KvEventRelay, modules: tuple) -> None:
        self.service = service
        self.pipeline = Pipeline(service)
        self.relay = relay
        self.grpc, self.common, self.pb, _ = modules
        self.started = time.time()
        self.streams: dict[str, asyncio.Task] = {}  # smg's request id -> its Generate

    async def _refuse(self, context: Any, exc: APIError) -> None:
        code = getattr(self.grpc.StatusCode, _STATUS_CODES.get(exc.status, "INTERNAL"))
        await context.abort(code, exc.body().error.message)

    # ------------------------------------------------------------------ generate
    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 (the RPC's name)
        pb, pipeline = self.pb, self.pipeline
        try:
            with pipeline.counted("generate"):
                values = sampling_values(request.sampling_params)
            values.setdefault("max_tokens", self.service.options.default_max_tokens)
            if request.WhichOneof("input") == "tokenized":
                body = GenerateBody(input_ids=list(request.tokenized.input_ids),
                                    sampling_params=values)
            else:
                body = GenerateBody(text=request.text, sampling_params=values)
            opened = pipeline.open(body)
        except APIError as exc:
            await self._refuse(context, exc)
            return
        if request.request_id:
            self.streams[request.request_id] = asyncio.current_task()
        output_ids: dict[int, list[int]] = {}
        logprobs: dict[int, list[float]] = {}
        tops: dict[int, list[list[TopToken]]] = {}
        finish: dict[int, str] = {}
        usage = None
        try:
            async with aclosing(opened.stream()) as chunks:
                async for chunk in chunks:
                    for choice in chunk.choices:
                        output_ids.setdefault(choice.index, []).extend(choice.token_ids)
                        logprobs.setdefault(choice.index, []).extend(choice.logprobs or ())
                        tops.setdefault(choice.index, []).extend(choice.top_logprobs or ())
                        if choice.finish_reason is not None:
                            finish[choice.index] = choice.finish_reason
                        if request.stream and choice.token_ids:
                            yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
                                token_ids=choice.token_ids, index=choice.index,
                                completion_tokens=len(output_ids[choice.index]),
                                output_logprobs=self._logprobs(
                                    choice.token_ids, choice.logprobs, choice.top_logprobs)))
                    if chunk.usage:  # only the last chunk carries it
                        usage = chunk.usage
        except APIError as exc:
            await self._refuse(context, exc)
            return
        finally:
            self.streams.pop(request.request_id, None)
        details = usage.prompt_tokens_details
        for index in sorted(output_ids):
            ids = output_ids[index]
            # Streamed tokens went out in chunks already: the end names only how it ended.
            yield pb.GenerateResponse(complete=pb.GenerateComplete(
                output_ids=[] if request.stream else ids, finish_reason=finish.get(index, ""),
                prompt_tokens=usage.prompt_tokens, completion_tokens=len(ids),
                cached_tokens=details.cached_tokens, index=index,
                output_logprobs=None if request.stream else self._logprobs(
                    ids, logprobs[index], tops[index])))

    def _logprobs(self, ids: list[int], values: list[float] | None,
                  tops: list[list[TopToken]] | None) -> Any:
        """smg's OutputLogProbs: each token's logprob, and with ``logprobs`` = N > 0 its N
        most likely alternatives (vLLM's meaning of the parameter)."""
        if not values:
            return None
        return self.pb.OutputLogProbs(token_logprobs=values, token_ids=ids, top_logprobs=[
            self.pb.TopLogProbs(values=[t.logprob for t in top],
                                token_ids=[t.token_id for t in top]) for top in tops or ()])

    async def Abort(self, request: Any, context: Any) -> Any:  # noqa: N802
        for rid in request.request_ids:
            task = self.streams.pop(rid, None)
            if task is not None:
                task.cancel()
        return self.pb.AbortResponse()

    # -------------------------------------------------------------- information
    async def HealthCheck(self, request: Any, context: Any) -> Any:  # noqa: N802
        reason = self.service.unhealthy()
        return self.pb.HealthCheckResponse(healthy=reason is None, message=reason or "ok")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        service, info = self.service, self.service.info
        return self.pb.GetModelInfoResponse(
            model_path=service.config.model, tokenizer_path=service.config.model,
            served_model_name=service.model_name, is_generation=True,
            max_context_length=info.context_len, max_req_input_len=info.context_len - 1,
            vocab_size=info.vocab_size, architectures=[info.architecture],
            eos_token_ids=info.eos_token_ids)

    async def GetServerInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        config = self.service.config
        return self.pb.GetServerInfoResponse(
            active_requests=self.service.client.num_pending, uptime_seconds=time.time()
            - self.started, server_type="radixserve-grpc", data_parallel_size=1,
            block_size=config.kv_events_block, model_dtype=self.service.info.dtype,
            max_num_seqs=config.max_running_requests)

    async def GetLoads(self, request: Any, context: Any) -> Any:  # noqa: N802
        stats, page = self.service.client.stats, self.service.info.page_size
        total = stats.kv_pages_total * page
        load = self.pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=stats.running, num_waiting_reqs=stats.waiting,
            num_total_reqs=stats.running + stats.waiting,
            num_used_tokens=stats.kv_pages_used * page, max_total_num_tokens=total,
            token_usage=stats.kv_pages_used / stats.kv_pages_total if total else 0.0,
            cache_hit_rate=stats.hit_tokens / stats.queried_tokens if stats.queried_tokens
            else 0.0, max_running_requests=self.service.config.max_running_requests)
        return self.pb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(), version="radixserve",
            dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            # Read at start (GrpcFrontend.start): what the engine loaded, even if its
            # directory has gone since.
            data, digest = await asyncio.to_thread(tokenizer_bundle, self.service.config.model)
        except OSError as exc:
            await context.abort(self.grpc.StatusCode.NOT_FOUND, str(exc))
            return
        for chunk, sha256 in bundle_chunks(data, digest, TOKENIZER_CHUNK_BYTES):
            yield self.common.GetTokenizerChunk(data=chunk, sha256=sha256)

    async def SubscribeKvEvents(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The relay's batches, with a load record (a ``load_only`` batch repeating the last
        sequence sent) when the stream opens with nothing to replay and after each second
        without a batch: smg takes a stream that sends nothing within 2 s, or a worker it has
        not heard from in a few, for a dead one. Before the stream's first batch a load record
        is numbered 0, which only a subscriber that asks for it
        (``load_records_before_first_batch``) knows not to take for batch 0."""
        last_sent: int | None = None
        samples = 0
        async with aclosing(self.relay.subscribe(request.start_sequence_number,
                                                 HEARTBEAT_SECONDS)) as batches:
            async for batch in batches:
                if batch is not None:
                    last_sent = batch.sequence_number
                    yield batch
                elif last_sent is not None or request.load_records_before_first_batch:
                    samples += 1
                    yield self.common.KvEventBatch(
                        sequence_number=last_sent or 0, timestamp=time.time(), dp_rank=0,
                        load=self._engine_load(samples))

    def _engine_load(self, sample: int) -> Any:
        stats, config = self.service.client.stats, self.service.config
        return self.common.EngineLoad(
            running_requests=stats.running, waiting_requests=stats.waiting,
            token_usage=stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total
            else 0.0, max_running_requests=config.max_running_requests, sample=sample,
            load_only=True)


def key_check(grpc: ModuleType, pipeline: Pipeline) -> Any:
    """A server interceptor that refuses every RPC without the API key (UNAUTHENTICATED), by
    swapping in a handler that aborts: the servicer's method never runs."""

    def refusing(handler: Any, message: str) -> Any:
        async def unary(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def stream(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # never reached: makes this a streaming handler

        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(stream if kind.endswith("_stream") else unary,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    class KeyCheck(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            metadata = dict(details.invocation_metadata or ())
            try:
                pipeline.authorize(Pipeline.bearer(metadata.get("authorization")),
                                   "send 'authorization: Bearer <key>' metadata")
            except APIError as exc:
                logger.warning("gRPC %s refused: %s", details.method, exc.message)
                return None if handler is None else refusing(handler, exc.message)
            return handler

    return KeyCheck()


class GrpcFrontend:
    """The gRPC server and its KV event relay. Built before the engine starts (so a missing
    dependency fails at once); ``start`` binds and serves on the running event loop."""

    def __init__(self, host: str, port: int, kv_events_endpoint: str) -> None:
        self.modules = load_grpc()
        self.host, self.port = host, port
        self.kv_events_endpoint = kv_events_endpoint
        self.server: Any = None
        self.relay: KvEventRelay | None = None

    async def start(self, service: Service) -> None:
        grpc, common, _, pb_grpc = self.modules
        # Subscribed before the door opens: no request reaches the engine before the relay.
        self.relay = KvEventRelay(self.kv_events_endpoint, common)
        self.relay.start()
        servicer = type("VllmEngineServicer", (VllmEngineDoor, pb_grpc.VllmEngineServicer),
                        {})(service, self.relay, self.modules)
        try:
            await asyncio.to_thread(tokenizer_bundle, service.config.model)  # cached
        except OSError:
            pass  # GetTokenizer answers NOT_FOUND with the reason
        # so_reuseport off: a second server on the same port must fail, not share it.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                      interceptors=[key_check(grpc, servicer.pipeline)])
        pb_grpc.add_VllmEngineServicer_to_server(servicer, self.server)
        address = host_port(self.host, self.port)
        try:
            self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        await self.server.start()

    async def stop(self, grace: float = DOOR_STOP_GRACE) -> None:
        if self.relay is not None:
            self.relay.close()
        if self.server is not None:
            await self.server.stop(grace)
