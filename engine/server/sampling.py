"""OpenAI request bodies → the engine's ``SamplingParams`` and prompts, with 400s naming the
field. Every number is range-checked here against the model (``ModelInfo``: vocabulary and
context) and against what the engine can represent (``SamplingParams.validate``), so nothing
a client sends can overflow a process further down. The tokenizer and the scheduler check what
only they can (a text's token count, the KV pool); here is what needs no tokenizer."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from engine.contracts.sampling_params import InvalidParam, SamplingParams, show_int
from engine.contracts.structured import StructuredOutputs
from engine.contracts.worker_messages import ModelInfo
from engine.server.errors import APIError
from engine.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

MAX_PROMPTS = 1024  # prompts in one /v1/completions request
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Chat messages are the only bodies that keep arbitrary JSON (extra fields pass through to the
# chat template); real ones (tool calls, content parts) nest a handful of levels. A bound keeps
# template code, which recurses, far from Python's recursion limit.
MAX_MESSAGE_DEPTH = 32
_PARAM_NAMES = frozenset(f.name for f in msgspec.structs.fields(SamplingParams))
# OpenAI fields that SamplingParams fields are derived from, for errors that name them.
_OPENAI_FIELDS = {"beam_width": "best_of"}


def _validated(params: SamplingParams, info: ModelInfo,
               names: dict[str, str] | None = None, prefix: str = "") -> SamplingParams:
    try:
        params.validate(vocab_size=info.vocab_size, context_len=info.context_len)
    except InvalidParam as exc:
        field = (names or {}).get(exc.field, exc.field)
        raise APIError(400, str(exc), param=prefix + field) from None
    return params


def _common(req: SamplingFields, max_tokens: int, logprobs: int | None, info: ModelInfo,
            names: dict[str, str], constraint: StructuredOutputs | None = None
            ) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if req.n < 1:
        raise APIError(400, f"n must be at least 1, got {req.n}", param="n")
    if req.best_of is not None and req.best_of < 1:
        raise APIError(400, f"best_of must be at least 1, got {req.best_of}", param="best_of")
    beam_width = 1
    if req.use_beam_search:
        beam_width = max(req.best_of or req.n, req.n)
    elif req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n needs use_beam_search: true (ranking sampled "
                       "candidates is not supported)", param="best_of")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    values: dict[str, Any] = {
        "max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "seed": req.seed,
    }
    params = SamplingParams(
        **{k: v for k, v in values.items() if v is not None},
        stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        n=req.n, beam_width=beam_width, length_penalty=req.length_penalty, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )
    if beam_width > 1:
        params.temperature = 0.0  # beam search is deterministic
    params.structured_outputs = constraint or constraint_of(req)
    return _validated(params, info, names)


def constraint_param(req: Any) -> str:
    """The field a request's output constraint came in (``constraint_of``'s source)."""
    return "response_format" if getattr(req, "response_format", None) is not None else \
        "structured_outputs"


def structured_outputs(value: Any, param: str = "structured_outputs") -> StructuredOutputs:
    """vLLM's ``structured_outputs`` object (``json`` may be the schema itself or its text)."""
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be an object", param=param)
    if isinstance(value.get("json"), dict | bool):
        value = {**value, "json": json.dumps(value["json"])}
    try:
        spec = msgspec.convert(value, StructuredOutputs)
        spec.kind  # noqa: B018 (raises unless exactly one constraint is set)
    except (msgspec.ValidationError, ValueError) as exc:
        raise APIError(400, f"invalid {param}: {exc}", param=param) from None
    return spec


def constraint_of(req: SamplingFields) -> StructuredOutputs | None:
    """The request's constraint: OpenAI's ``response_format`` or vLLM's ``structured_outputs``
    (not both)."""
    fmt = req.response_format
    if fmt is not None and req.structured_outputs is not None:
        raise APIError(400, "give response_format or structured_outputs, not both",
                       param="response_format")
    if req.structured_outputs is not None:
        return structured_outputs(req.structured_outputs)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.type != "json_schema":
        raise APIError(400, f"response_format.type must be text, json_object or json_schema, "
                       f"got {fmt.type!r}", param="response_format.type")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema",
                       param="response_format.json_schema")
    return StructuredOutputs(json=json.dumps(fmt.json_schema.schema))


def completion_params(req: CompletionRequest, info: ModelInfo) -> SamplingParams:
    """With ``echo``, ``logprobs`` covers the prompt's tokens too (``prompt_logprobs``), and
    ``max_tokens`` may be 0 (scoring a prompt, as lm-evaluation-harness does): the engine then
    samples one token, which the response leaves out (``echo_only``)."""
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if echo_only(req):
        max_tokens = 1
    params = _common(req, max_tokens, req.logprobs, info, _OPENAI_FIELDS)
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = params.logprobs
        if params.beam_width > 1:
            raise APIError(400, "echo with logprobs cannot be combined with beam search",
                           param="echo")
    return params


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the prompt alone comes back."""
    return req.echo and req.max_tokens == 0


def chat_params(req: ChatCompletionRequest, default_max_tokens: int, info: ModelInfo,
                constraint: StructuredOutputs | None = None) -> SamplingParams:
    """``constraint``: the grammar of a tool_choice (engine/server/tools.py), which takes the
    place of response_format and structured_outputs."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be between 0 and 20, got {req.top_logprobs}",
                       param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    # The default must still fit beside a prompt in a model with a short context.
    default = min(default_max_tokens, info.context_len)
    names = {**_OPENAI_FIELDS, "logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _common(req, default if max_tokens is None else max_tokens, logprobs, info, names,
                   constraint)


def native_params(values: dict[str, Any], info: ModelInfo) -> SamplingParams:
    """``/generate``'s ``sampling_params``: SamplingParams' own fields, strictly."""
    unknown = sorted(set(values) - _PARAM_NAMES)
    if unknown:
        raise APIError(400, f"unknown sampling parameter {unknown[0]!r}",
                       param=f"sampling_params.{unknown[0]}")
    if "structured_outputs" in values and values["structured_outputs"] is not None:
        spec = structured_outputs(values["structured_outputs"], "sampling_params.structured_outputs")
        values = {**values, "structured_outputs": msgspec.to_builtins(spec)}
    try:
        params = msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid sampling_params: {exc}", param="sampling_params") from None
    return _validated(params, info, prefix="sampling_params.")


def _is_ids(value: Any) -> bool:
    # The types' set in C loops (a Python loop over a 512-token prompt took ~60 us); a decoded
    # body's ints are exact ints, its true/false bools, so bools are not ids.
    return isinstance(value, list) and bool(value) and {*map(type, value)} == {int}


def check_prompt_ids(ids: list[int], info: ModelInfo, max_tokens: int, param: str) -> None:
    """Token ids in the vocabulary, and few enough to leave room for ``max_tokens``."""
    if len(ids) + max_tokens > info.context_len:
        raise APIError(400, f"the prompt has {len(ids):,} tokens and max_tokens is "
                       f"{max_tokens:,}, but the model's context is {info.context_len:,} tokens",
                       param=param)
    low, high = min(ids), max(ids)  # C loops: a prompt may hold millions of ids
    if low < 0 or high >= info.vocab_size:
        raise APIError(400, f"prompt token ids must be in [0, {info.vocab_size}), got "
                       f"{show_int(low if low < 0 else high)}", param=param)


def completion_prompts(prompt: str | list[Any], info: ModelInfo,
                       max_tokens: int) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists → one
    prompt per engine request."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if len(prompt) > MAX_PROMPTS and not _is_ids(prompt):
        raise APIError(400, f"at most {MAX_PROMPTS:,} prompts fit in one request, got "
                       f"{len(prompt):,}", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if _is_ids(prompt):
        check_prompt_ids(prompt, info, max_tokens, "prompt")
        return [prompt]
    if all(_is_ids(p) for p in prompt):
        for ids in prompt:
            check_prompt_ids(ids, info, max_tokens, "prompt")
        return list(prompt)
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                   "list of non-empty token-id lists", param="prompt")


def check_messages(messages: list[Any], name: str = "messages") -> None:
    """Chat messages (or the chat template's tools, ``name``) nest at most
    ``MAX_MESSAGE_DEPTH`` levels (extra fields included), and every integer in them fits the 64
    bits the messages travel in (msgpack) to the tokenizer."""
    # Iterative: a recursive walk would meet the recursion limit it is here to keep away from.
    stack: list[tuple[Any, int, int]] = [(m, 1, i) for i, m in enumerate(messages)]
    while stack:
        value, depth, index = stack.pop()
        if depth > MAX_MESSAGE_DEPTH:
            raise APIError(400, f"{name}[{index}] nests deeper than {MAX_MESSAGE_DEPTH} "
                           "levels", param=f"{name}[{index}]")
        children = value.values() if isinstance(value, dict) else value  # only these stack
        if any(isinstance(child, int) and not -(1 << 63) <= child < (1 << 64)
               for child in children):
            raise APIError(400, f"{name}[{index}] holds an integer outside 64 bits",
                           param=f"{name}[{index}]")
        stack.extend((child, depth + 1, index) for child in children
                     if isinstance(child, dict | list))
