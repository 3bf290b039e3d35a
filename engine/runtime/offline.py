"""Offline Python API: ``Engine`` starts the process group in-process.

    from engine import Engine, SamplingParams
    with Engine() as engine:    # SmolLM2-135M-Instruct; or Engine(model="dir" | "x.gguf" | "demo")
        out = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
        print(out[0].text, out[0].cached_tokens)

The frontend client runs on an event loop in a background thread; ``generate`` blocks on it,
``stream`` is an async generator usable from any event loop.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.checkpoints.model_source import resolve_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import GenerateRequest, RequestOutput, pack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.worker_messages import ModelInfo
from engine.runtime.client import EngineClient, EngineDead, new_request_id
from engine.runtime.launcher import Launcher, LaunchError

Prompt = str | Sequence[int] | list[dict[str, Any]]


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestResult:
    rid: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    outputs: list[Completion] = field(default_factory=list)
    error: str | None = None
    status: int = 200

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    def add(self, out: RequestOutput) -> None:
        """Fold one streamed delta into the result."""
        if out.error is not None:
            self.error, self.status = out.error, out.status
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        while len(self.outputs) <= out.index:
            self.outputs.append(Completion(len(self.outputs)))
        c = self.outputs[out.index]
        ids = np.frombuffer(out.token_ids, dtype=np.int32).tolist()
        if out.replace:
            c.text, c.token_ids = "", []
        c.text += out.text
        c.token_ids += ids
        if out.logprobs:
            c.logprobs = (c.logprobs or []) + np.frombuffer(out.logprobs, np.float32).tolist()
        if out.top_ids and ids:
            tid = np.frombuffer(out.top_ids, np.int32).reshape(len(ids), -1)
            tlp = np.frombuffer(out.top_logprobs, np.float32).reshape(tid.shape)
            c.top_logprobs = (c.top_logprobs or []) + [
                dict(zip(a.tolist(), b.tolist(), strict=True))
                for a, b in zip(tid, tlp, strict=True)]
        c.finish_reason = out.finish_reason or c.finish_reason


def make_request(prompt: Prompt, params: SamplingParams, rid: str | None = None,
                 **extra: Any) -> GenerateRequest:
    rid = rid or new_request_id()
    if isinstance(prompt, str):
        return GenerateRequest(rid=rid, params=params, text=prompt, **extra)
    if len(prompt) and isinstance(prompt[0], dict):
        return GenerateRequest(rid=rid, params=params, messages=list(prompt), **extra)
    return GenerateRequest(rid=rid, params=params, prompt_ids=pack_ids(list(prompt)), **extra)


class Engine:
    """The whole process group (tokenizer, scheduler, worker) for offline use."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        source = resolve_model(model)
        options["served_model_name"] = options.get("served_model_name") or source.name
        self.config = EngineConfig(model=source.path, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="radixserve-frontend")
        self._thread.start()
        self.launcher = Launcher(self.config, on_death=self._on_death)
        self.client: EngineClient | None = None
        try:
            self.info: ModelInfo = self.launcher.start()
            self.client = self._call(self._make_client())
        except BaseException:
            self.close()
            raise

    async def _make_client(self) -> EngineClient:
        client = EngineClient(self.launcher.endpoints)
        client.start()
        return client

    def _on_death(self, reason: str) -> None:
        if self.client is not None:
            self._loop.call_soon_threadsafe(self.client.fail_all, reason)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ----------------------------------------------------------------- API
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | None = None) -> list[RequestResult]:
        """Generate for every prompt (text, token ids or chat messages); results in order.
        A request that fails has ``error`` set; the engine dying raises EngineDead."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if use_tqdm is None:
            use_tqdm = len(prompts) >= 32 and sys.stderr.isatty()
        return self._call(self._generate_all(list(prompts), list(params), use_tqdm))

    async def _generate_all(self, prompts, params, use_tqdm: bool) -> list[RequestResult]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")

        async def one(prompt: Prompt, p: SamplingParams) -> RequestResult:
            req = make_request(prompt, p)
            result = RequestResult(req.rid)
            async for out in self.client.stream(req):
                result.add(out)
            if bar is not None:
                bar.update(1)
            return result

        try:
            return list(await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params,
                                                                           strict=True))))
        finally:
            if bar is not None:
                bar.close()

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     **extra: Any) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas into the caller's event loop."""
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = make_request(prompt, params or SamplingParams(), **extra)

        async def pump() -> None:
            try:
                async for out in self.client.stream(req):
                    caller.call_soon_threadsafe(queue.put_nowait, out)
                caller.call_soon_threadsafe(queue.put_nowait, None)
            except BaseException as exc:  # hand the failure to the caller's loop
                caller.call_soon_threadsafe(queue.put_nowait, exc)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # the consumer went away: the client aborts the request

    # ----------------------------------------------------------- lifetime
    @property
    def alive(self) -> bool:
        return self.launcher.dead is None

    def close(self) -> None:
        if self.client is not None:
            self._loop.call_soon_threadsafe(self.client.close)
        self.launcher.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Completion", "Engine", "EngineDead", "LaunchError", "RequestResult", "make_request"]
