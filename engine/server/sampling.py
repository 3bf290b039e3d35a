"""OpenAI request bodies → the engine's ``SamplingParams`` and prompts, with 400s naming the
field. The scheduler checks again what only it can (prompt length against the context, token
ids against the vocabulary, KV pool size); here is what needs no tokenizer."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.protocol import SamplingParams
from engine.server.errors import APIError
from engine.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

MAX_PROMPTS = 1024  # prompts in one /v1/completions request
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_PARAM_NAMES = frozenset(f.name for f in msgspec.structs.fields(SamplingParams))


def _validated(params: SamplingParams) -> SamplingParams:
    try:
        params.validate()
    except ValueError as exc:
        message = str(exc)
        # validate()'s sentences start with the field's name.
        first = message.split(" ", 1)[0]
        raise APIError(400, message, param=first if first in _PARAM_NAMES else None) from None
    return params


def _common(req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if req.n < 1:
        raise APIError(400, f"n must be at least 1, got {req.n}", param="n")
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
    return _validated(params)


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return _common(req, max_tokens, req.logprobs)


def chat_params(req: ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be between 0 and 20, got {req.top_logprobs}",
                       param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _common(req, default_max_tokens if max_tokens is None else max_tokens, logprobs)


def native_params(values: dict[str, Any]) -> SamplingParams:
    """``/generate``'s ``sampling_params``: SamplingParams' own fields, strictly."""
    unknown = sorted(set(values) - _PARAM_NAMES)
    if unknown:
        raise APIError(400, f"unknown sampling parameter {unknown[0]!r}",
                       param=f"sampling_params.{unknown[0]}")
    try:
        params = msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid sampling_params: {exc}", param="sampling_params") from None
    return _validated(params)


def _is_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
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
        return [prompt]
    if all(_is_ids(p) for p in prompt):
        return list(prompt)
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                   "list of non-empty token-id lists", param="prompt")
