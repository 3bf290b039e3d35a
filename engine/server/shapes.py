"""A call (one API request in progress) and the OpenAI shapes of its outputs: completion and
chat chunks and responses (with ``echo``'s prompt and tool calls), ``/generate``'s.

``Shapes`` is the half of ``Service`` (engine/server/service.py) that turns the outputs
``Service._deltas`` folds into a call's choices into what each endpoint returns.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from msgspec import UNSET

from engine.contracts.protocol import GenerateRequest, RequestOutput
from engine.server import tools
from engine.server.choices import (
    Choice,
    Choices,
    TokenInfo,
    chat_logprobs,
    completion_logprobs,
    prompt_token_infos,
    top_tokens,
)
from engine.server.metrics import RequestTimer
from engine.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    GenerateChoice,
    GenerateResponse,
)

Delta = tuple[Choice, RequestOutput, list[int], list[TokenInfo]]


@dataclass
class Call:
    """One API request in progress: its engine requests and what they produced so far."""

    id: str
    created: int
    model: str
    requests: list[GenerateRequest]
    choices: Choices
    timer: RequestTimer
    # The field an engine-side 400 names: past the door's checks, every one is about the
    # prompt's tokens (too many for the context or the KV pool, none at all, bad messages).
    prompt_param: str = "prompt"
    # The field a 400 about the output constraint names (it failed to compile): the field the
    # request gave it in.
    constraint_param: str = "structured_outputs"
    return_token_ids: bool = False  # completions: choices carry their output token ids
    echo: bool = False  # completions: each choice starts with its prompt (text and logprobs)
    tool_plan: tools.ToolPlan | None = None  # chat: how the output becomes tool calls
    # Gives the call's places under --max-inflight-requests back: once its outputs are done
    # (``Service._deltas``), or when the call is dropped without ever running. Runs once.
    release: weakref.finalize | None = None


class Shapes:
    """The endpoints' shapes of a call's outputs (mixed into ``Service``, which provides
    ``_deltas``)."""

    # Service's: a call's engine outputs folded into its choices, one delta at a time
    _deltas: Callable[[Call], AsyncIterator[Delta]]

    async def _drain(self, call: Call) -> None:
        """Every output of ``call`` folded into its choices (a whole response's wait)."""
        async with aclosing(self._deltas(call)) as deltas:
            async for _ in deltas:
                pass

    async def completion_stream(self, call: Call, include_usage: bool,
                                top: bool) -> AsyncIterator[CompletionChunk]:
        usage = None if include_usage else UNSET
        async with aclosing(self._deltas(call)) as deltas:
            async for choice, out, ids, tokens in deltas:
                if not (out.text or ids or out.finish_reason):
                    continue
                text, offset = out.text, len(choice.text) - len(out.text)
                if call.echo:  # the choice's first chunk starts with its prompt
                    offset += len(call.choices.prompt_texts[choice.index // call.choices.n])
                    if not choice.started:
                        text, tokens = call.choices.echoed(choice, text, tokens)
                        offset = 0
                choice.started = True
                logprobs = completion_logprobs(tokens, offset, top) if tokens else None
                yield CompletionChunk(call.id, call.created, call.model, [CompletionChoice(
                    choice.index, text, logprobs, out.finish_reason,
                    ids if call.return_token_ids else UNSET)], usage)
        if include_usage:
            yield CompletionChunk(call.id, call.created, call.model, [], call.choices.usage())

    async def completion(self, call: Call, top: bool) -> CompletionResponse:
        await self._drain(call)
        choices = []
        for c in call.choices.choices:
            text, tokens = (call.choices.echoed(c, c.text, c.tokens) if call.echo
                            else (c.text, c.tokens))
            choices.append(CompletionChoice(
                c.index, text, completion_logprobs(tokens, 0, top) if tokens else None,
                c.finish_reason, c.token_ids if call.return_token_ids else UNSET))
        return CompletionResponse(call.id, call.created, call.model, choices,
                                  call.choices.usage())

    async def chat_stream(self, call: Call, include_usage: bool
                          ) -> AsyncIterator[ChatCompletionChunk]:
        usage = None if include_usage else UNSET

        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(call.id, call.created, call.model, [choice], usage)

        readers = None if call.tool_plan is None else tools.ToolStreams(
            call.tool_plan, len(call.choices.choices))
        async with aclosing(self._deltas(call)) as deltas:
            async for choice, out, _, tokens in deltas:
                if not choice.started:
                    choice.started = True
                    yield chunk(ChatChunkChoice(choice.index, ChatDelta("assistant", "")))
                finish = out.finish_reason
                if readers is None:
                    delta = ChatDelta(content=out.text) if out.text else None
                else:  # text becomes content and tool call deltas as the reader sees them
                    delta = readers.delta(choice.index, out.text, finish is not None)
                    if finish is not None:
                        finish = readers.finish_reason(choice.index, finish)
                if delta is not None or tokens:
                    yield chunk(ChatChunkChoice(choice.index, delta or ChatDelta(content=""),
                                                chat_logprobs(tokens) if tokens else None))
                if finish is not None:
                    yield chunk(ChatChunkChoice(choice.index, ChatDelta(),
                                                finish_reason=finish))
        if include_usage:
            yield ChatCompletionChunk(call.id, call.created, call.model, [],
                                      call.choices.usage())

    async def chat(self, call: Call) -> ChatCompletionResponse:
        await self._drain(call)
        choices = []
        for c in call.choices.choices:
            message, finish = (ChatMessage(c.text), c.finish_reason) if call.tool_plan is None \
                else call.tool_plan.message(c.text, c.finish_reason)
            choices.append(ChatChoice(c.index, message,
                                      chat_logprobs(c.tokens) if c.tokens else None, finish))
        return ChatCompletionResponse(call.id, call.created, call.model, choices,
                                      call.choices.usage())

    async def generate_stream(self, call: Call) -> AsyncIterator[GenerateResponse]:
        async with aclosing(self._deltas(call)) as deltas:
            async for choice, out, ids, tokens in deltas:
                # An output's prompt logprobs come in order, before any generated token.
                yield GenerateResponse(call.id, call.created, call.model, [_generate_choice(
                    choice.index, ids, out.text, out.finish_reason, tokens,
                    prompt_token_infos(out))])
        yield GenerateResponse(call.id, call.created, call.model, [], call.choices.usage())

    async def generate(self, call: Call) -> GenerateResponse:
        await self._drain(call)
        choices = [_generate_choice(c.index, c.token_ids, c.text, c.finish_reason, c.tokens,
                                    call.choices.prompt_infos[c.index // call.choices.n])
                   for c in call.choices.choices]
        return GenerateResponse(call.id, call.created, call.model, choices,
                                call.choices.usage())


def _generate_choice(index: int, ids: list[int], text: str, finish_reason: str | None,
                     tokens: list[TokenInfo], prompt: list[TokenInfo]) -> GenerateChoice:
    """``/generate``'s choice; with prompt logprobs, the prompt's (None for its first token)
    and, when asked, each prompt token's alternatives by id."""
    return GenerateChoice(index, ids, text, finish_reason,
                          [t.logprob for t in tokens] if tokens else None, top_tokens(tokens),
                          [t.logprob for t in prompt] if prompt else UNSET,
                          top_tokens(prompt) or UNSET)
