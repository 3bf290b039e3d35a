"""The serving core behind both front doors (HTTP and ZMQ): a validated request body in,
OpenAI-shaped stream chunks or a whole response out, through the ``EngineClient``.

Every stream is an async generator that yields nothing until the engine's first output has
arrived, so the caller can await the first chunk before committing to a status: a request the
tokenizer or scheduler refuses (over-long prompt, queue full) is a plain error response, not a
broken stream. Closing a stream early (client gone) closes the engine streams under it, which
abort their requests. Metrics are recorded once per request, however it ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import msgspec

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import (
    DetokenizeRequest,
    GenerateRequest,
    LoraUpdate,
    RequestOutput,
    SessionClose,
    SessionOpen,
    TokenizeRequest,
    TokenizerReply,
    pack_ids,
    unpack_ids,
)
from engine.contracts.worker_messages import ModelInfo
from engine.runtime.client import EngineClient, EngineDead, new_request_id
from engine.server import sampling, tools
from engine.server.choices import Choices
from engine.server.dp_monitor import DispatchMonitor
from engine.server.errors import APIError
from engine.server.metrics import FrontendState, Metrics
from engine.server.options import ServeOptions
from engine.server.response_store import ResponseStore
from engine.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    DetokenizeResponse,
    GenerateBody,
    LoadLoraAdapterBody,
    ModelCard,
    ModelList,
    SessionDeleted,
    SessionObject,
    TokenizeBody,
    TokenizeResponse,
    UnloadLoraAdapterBody,
)
from engine.server.session_table import SessionTable
from engine.server.shapes import Call, Delta, Shapes


class Service(Shapes):
    def __init__(self, client: EngineClient, info: ModelInfo, config: EngineConfig,
                 options: ServeOptions | None = None,
                 dispatch: DispatchMonitor | None = None) -> None:
        self.client = client
        self.info = info
        self.config = config
        self.options = options or ServeOptions()
        self.model_name = config.served_model_name or Path(config.model).name
        # Engine requests of calls admitted and not yet done: counted when the call is made,
        # so concurrent arrivals see each other before any of them reaches the engine.
        self.admitted = 0
        self.shutting_down = False  # set on SIGTERM: new requests get 503, running ones finish
        self.door_failure: str | None = None  # why a front door (ZMQ) stopped receiving
        self.sessions = SessionTable(config.max_sessions, config.session_ttl)
        self.stored = ResponseStore()  # /v1/responses' stored responses, each a session's
        if dispatch is None:
            self.metrics = Metrics(lambda: client.stats, self._frontend_state, info)
        else:  # data parallel: the replicas' stats summed, and each replica's own
            self.metrics = Metrics(dispatch.reports.total_stats, self._frontend_state, info)
            self.metrics.registry.register(dispatch.reports.collector())
        self.created = int(time.time())

    def _frontend_state(self) -> FrontendState:
        return FrontendState(self.client.num_pending, len(self.sessions), self.client.dead is None)

    def unhealthy(self) -> str | None:
        """Why ``/health`` fails, or None while the server serves every door."""
        if self.shutting_down:
            return "the server is shutting down"
        if self.client.dead is not None:
            return f"the engine stopped: {self.client.dead}"
        return self.door_failure

    def _check_alive(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down and takes no new requests; "
                           "retry on another server")
        if self.client.dead is not None:
            raise APIError(503, f"the engine stopped: {self.client.dead}")

    # ---------------------------------------------------------------- models
    def models(self) -> ModelList:
        base = ModelCard(self.model_name, self.created, self.info.context_len)
        return ModelList([base] + [
            ModelCard(adapter.name, self.created, self.info.context_len, parent=self.model_name)
            for adapter in self.info.lora_adapters])

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter ``name`` (a request's ``model``) selects, None for the base model;
        404 for a name this server does not serve."""
        if not name or name in (self.model_name, self.config.model):
            return None
        if any(adapter.name == name for adapter in self.info.lora_adapters):
            return name
        adapters = "".join(f", {a.name!r}" for a in self.info.lora_adapters)
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{self.model_name!r}{adapters}", param="model", code="model_not_found")

    # ---------------------------------------------------------- LoRA adapters
    async def update_lora(self, body: LoadLoraAdapterBody | UnloadLoraAdapterBody) -> str:
        """Load or unload an adapter (``--enable-runtime-lora-updating``); vLLM's success
        text, or an APIError with the engine's sentence."""
        self._check_alive()
        if not self.config.enable_lora:
            raise APIError(400, "LoRA adapters need a server started with --enable-lora")
        loading = isinstance(body, LoadLoraAdapterBody)
        if loading and body.lora_name in (self.model_name, self.config.model):
            raise APIError(400, f"{body.lora_name!r} is the base model's name; give the "
                           "adapter another", param="lora_name")
        update = LoraUpdate(rid=new_request_id(), name=body.lora_name,
                            path=body.lora_path if loading else None)
        try:
            answer = await self.client.update_lora(update)
        except EngineDead as exc:
            raise APIError(503, f"the engine stopped: {exc}") from None
        self.info.lora_adapters = answer.adapters
        if answer.error is not None:
            param = "lora_path" if loading and answer.status == 400 and (
                "already loaded" not in answer.error) else "lora_name"
            raise APIError(answer.status, answer.error, param=param)
        done = "added" if loading else "removed"
        return f"Success: LoRA adapter '{body.lora_name}' {done} successfully."

    # ------------------------------------------------------------ tokenizing
    async def tokenize(self, body: TokenizeBody) -> TokenizeResponse:
        """vLLM's ``/tokenize``: the ids a completion (``prompt``) or a chat completion
        (``messages``, rendered by the same template) would run on."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (chat)",
                           param="prompt")
        if body.messages is None and body.add_generation_prompt is not None:
            raise APIError(400, "add_generation_prompt applies to messages, not to a prompt",
                           param="add_generation_prompt")
        if body.messages is not None:
            sampling.check_messages(body.messages)
        chat = body.messages is not None
        msg = TokenizeRequest(
            rid=new_request_id(), text=body.prompt, messages=body.messages,
            add_special_tokens=not chat if body.add_special_tokens is None
            else body.add_special_tokens,
            add_generation_prompt=body.add_generation_prompt in (None, True),
            return_token_strs=body.return_token_strs)
        reply = await self._tokenizer_call(msg, "messages" if chat else "prompt")
        ids = unpack_ids(reply.token_ids).tolist()
        return TokenizeResponse(ids, len(ids), self.info.context_len, reply.token_strs)

    async def count_chat_tokens(self, req: ChatCompletionRequest) -> int:
        """The prompt tokens a chat request of ``req``'s messages and tools runs on."""
        self.check_model(req.model)
        template_tools, _ = tools.resolve(req, self.options.tool_call_parser)
        sampling.check_messages(req.messages)
        sampling.check_messages(template_tools or [], "tools")
        msg = TokenizeRequest(rid=new_request_id(), messages=req.messages, tools=template_tools,
                              add_special_tokens=False)
        reply = await self._tokenizer_call(msg, "messages")
        return len(unpack_ids(reply.token_ids))

    async def detokenize(self, body: DetokenizeBody) -> DetokenizeResponse:
        """vLLM's ``/detokenize``: ids of the model's vocabulary to text, special tokens
        spelled out."""
        self.check_model(body.model)
        if body.tokens:
            low, high = min(body.tokens), max(body.tokens)
            if low < 0 or high >= self.info.vocab_size:
                raise APIError(400, f"tokens must be ids in [0, {self.info.vocab_size:,}), the "
                               f"model's vocabulary, got {low if low < 0 else high:,}",
                               param="tokens")
        reply = await self._tokenizer_call(
            DetokenizeRequest(rid=new_request_id(), token_ids=pack_ids(body.tokens)), "tokens")
        return DetokenizeResponse(reply.text)

    async def _tokenizer_call(self, msg: TokenizeRequest | DetokenizeRequest,
                              param: str) -> TokenizerReply:
        self._check_alive()
        try:
            reply = await self.client.tokenize(msg)
        except EngineDead as exc:
            raise APIError(503, f"the engine stopped: {exc}") from None
        if reply.error is not None:
            raise APIError(reply.status, reply.error,
                           param=param if reply.status == 400 else None)
        return reply

    # -------------------------------------------------------------- sessions
    async def open_session(self, parent: str | None = None) -> SessionObject:
        """A new session; with ``parent``, its history starts as a copy of that session's."""
        self._check_alive()
        session, reclaimed = self.sessions.open()
        if reclaimed is not None:
            self.stored.forget_session(reclaimed)
            await self.client.send_session(SessionClose(reclaimed))
        await self._send_session(SessionOpen(session.id, self.config.session_ttl, parent))
        return SessionObject(session.id, int(session.created), self.config.session_ttl)

    async def close_session(self, session_id: str) -> SessionDeleted:
        self.sessions.close(session_id)
        await self._send_session(SessionClose(session_id))
        return SessionDeleted(session_id)

    async def _send_session(self, msg: SessionOpen | SessionClose) -> None:
        try:
            await self.client.send_session(msg)
        except EngineDead as exc:
            raise APIError(503, f"the engine stopped: {exc}") from None

    # ------------------------------------------------------------- requests
    def _call(self, prefix: str, endpoint: str, requests: list[GenerateRequest],
              n: int, discard: bool = False, **fields: Any) -> Call:
        """The call of admitted engine requests; ``fields``: the endpoint's own ``Call``
        fields. Answers name the adapter the requests run under, else the model."""
        self._check_alive()
        limit = self.options.max_inflight_requests
        if len(requests) > limit:
            raise APIError(400, f"the request has {len(requests):,} prompts but the server "
                           f"takes at most {limit:,} requests in flight", param="prompt")
        if self.admitted + len(requests) > limit:
            raise APIError(503, f"the server is at its limit of {limit:,} requests "
                           f"in flight ({self.admitted:,} now, this one adds "
                           f"{len(requests):,}); retry later")
        call = Call(f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                    requests[0].lora_name or self.model_name, requests,
                    Choices(len(requests), n, discard),
                    self.metrics.track(endpoint, requests[0].lora_name), **fields)
        self.admitted += len(requests)
        call.release = weakref.finalize(call, self._release, len(requests))
        return call

    def _release(self, count: int) -> None:
        self.admitted -= count

    def completion_call(self, req: CompletionRequest) -> Call:
        adapter = self.check_model(req.model)
        params = sampling.completion_params(req, self.info)
        namespace = self._namespace(req.cache_salt, req.user)
        requests = [GenerateRequest(rid=new_request_id(), params=params, namespace=namespace,
                                    echo=req.echo, lora_name=adapter, **_prompt_fields(prompt))
                    for prompt in sampling.completion_prompts(req.prompt, self.info,
                                                              params.max_tokens)]
        return self._call("cmpl", "completions", requests, params.n,
                          discard=sampling.echo_only(req),
                          return_token_ids=req.return_token_ids, echo=req.echo,
                          constraint_param=sampling.constraint_param(req))

    def chat_call(self, req: ChatCompletionRequest, endpoint: str = "chat",
                  prefix: str = "chatcmpl") -> Call:
        """A chat completion; the Messages and Responses APIs run as one too (``endpoint``:
        their label in /metrics, ``prefix``: their ids')."""
        adapter = self.check_model(req.model)
        template_tools, plan = tools.resolve(req, self.options.tool_call_parser)
        params = sampling.chat_params(req, self.options.default_max_tokens, self.info,
                                      plan.constraint if plan is not None else None)
        sampling.check_messages(req.messages)
        sampling.check_messages(template_tools or [], "tools")
        if req.session_id is not None:
            self.sessions.get(req.session_id)  # 404 now, before any stream starts
        request = GenerateRequest(rid=new_request_id(), params=params, messages=req.messages,
                                  tools=template_tools, session_id=req.session_id,
                                  namespace=self._namespace(req.cache_salt, req.user),
                                  lora_name=adapter)
        return self._call(prefix, endpoint, [request], params.n, prompt_param="messages",
                          tool_plan=plan, constraint_param="tool_choice" if plan is not None
                          and plan.constraint is not None else sampling.constraint_param(req))

    def generate_call(self, body: GenerateBody) -> Call:
        adapter = self.check_model(body.model)
        params = sampling.native_params(body.sampling_params, self.info)
        if (body.input_ids is None) == (body.text is None):
            raise APIError(400, "give exactly one of input_ids (token ids) or text",
                           param="input_ids")
        if body.input_ids is not None:
            if not body.input_ids:
                raise APIError(400, "input_ids must not be empty", param="input_ids")
            sampling.check_prompt_ids(body.input_ids, self.info, params.max_tokens, "input_ids")
        prompt = body.input_ids if body.input_ids is not None else body.text
        request = GenerateRequest(rid=new_request_id(), params=params,
                                  namespace=self._namespace(body.cache_salt),
                                  lora_name=adapter, **_prompt_fields(prompt))
        return self._call("gen", "generate", [request], params.n,
                          prompt_param="input_ids" if body.input_ids is not None else "text",
                          constraint_param="sampling_params.structured_outputs")

    def _namespace(self, cache_salt: str | None, user: str | None = None) -> str | None:
        """The radix tree namespace of a request; requests in different namespaces never share
        cached KV. It is the request's ``cache_salt`` and, with ``--salt-from-user``, its
        ``user`` as well: both count, so no salt reaches into another user's cache. Hashed, so
        a long salt costs the scheduler no more than a short one."""
        if cache_salt is not None and not cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string when given",
                           param="cache_salt")
        owner = user if self.options.salt_from_user and user else None
        if cache_salt is None and owner is None:
            return None
        return hashlib.sha256(msgspec.json.encode([owner, cache_salt])).hexdigest()

    # -------------------------------------------------------------- running
    async def _deltas(self, call: Call) -> AsyncIterator[Delta]:
        """Engine outputs folded into the call's choices; an engine error raises APIError."""
        session = None
        sid = call.requests[0].session_id
        status = 499  # the client went away, unless something below says otherwise
        try:
            if sid is not None:
                session = self.sessions.begin_turn(sid)
            async with aclosing(self._merged(call.requests)) as outputs:
                async for index, out in outputs:
                    if out.finish_reason == "error":
                        status = 503 if self.client.dead is not None else out.status
                        param = call.constraint_param if out.about_constraint else \
                            call.prompt_param
                        raise APIError(status, out.error or "the request failed",
                                       param=param if status == 400 else None)
                    choice, ids, tokens = call.choices.add(index, out)
                    call.timer.tokens(choice.index, len(ids), out.result_at)
                    yield choice, out, ids, tokens
            status = 200
        except APIError as exc:
            status = exc.status
            raise
        except EngineDead as exc:
            status = 503
            # A shutdown's reason is a sentence of its own; a dead process's needs the context.
            raise APIError(503, str(exc) if self.shutting_down
                           else f"the engine stopped: {exc}") from None
        finally:
            call.release()
            if session is not None:
                self.sessions.end_turn(session)
            c = call.choices
            call.timer.finish(status, sum(c.prompt_tokens), sum(c.cached_tokens),
                              c.completion_tokens)

    async def _merged(self, requests: list[GenerateRequest]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every engine request as they come, tagged with the request's index."""
        if len(requests) == 1:
            async with aclosing(self.client.stream(requests[0])) as stream:
                async for out in stream:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, req: GenerateRequest) -> None:
            try:
                async with aclosing(self.client.stream(req)) as stream:
                    async for out in stream:
                        queue.put_nowait((index, out))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_fields(prompt: str | list[int]) -> dict[str, str | bytes]:
    """A ``GenerateRequest``'s prompt: ``text``, or token ids packed as ``prompt_ids``."""
    return {"text": prompt} if isinstance(prompt, str) else {"prompt_ids": pack_ids(prompt)}
