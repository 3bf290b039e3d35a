"""Engine outputs → OpenAI choices: per-choice text, token ids and logprobs (the delta of one
output for a stream chunk, or everything for a full response), and the request's usage.

A request of ``k`` prompts and ``n`` samples has ``k * n`` choices; choice ``i * n + j`` is
sample ``j`` of prompt ``i`` (OpenAI's order). Beam search sends each final beam whole
(``replace``), which resets that choice. Each prompt's own text and its tokens' logprobs (for
``echo``) are kept once per prompt, beside its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from msgspec import UNSET

from engine.contracts.protocol import RequestOutput, unpack_ids
from engine.server.schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    TopToken,
    Usage,
)


@dataclass
class TokenInfo:
    """One token with its logprob and the top alternatives, named by their text (and by their
    ids in ``top_ids``); a prompt's first token has none (``logprob`` None)."""

    text: str
    logprob: float | None
    top: list[tuple[str, float]]
    top_ids: list[int]  # the alternatives' token ids, in ``top``'s order


def token_infos(out: RequestOutput) -> list[TokenInfo]:
    """The tokens of one output with logprobs; empty when none were asked for."""
    return _infos(out.token_texts, out.logprobs, out.top_texts, out.top_logprobs, out.top_ids)


def prompt_token_infos(out: RequestOutput) -> list[TokenInfo]:
    """The prompt tokens an output carries logprobs for (``prompt_logprobs``)."""
    return _infos(out.prompt_token_texts, out.prompt_logprobs, out.prompt_top_texts,
                  out.prompt_top_logprobs, out.prompt_top_ids)


def _infos(texts: list[str], logprobs: bytes, top_texts: list[str], top_logprobs: bytes,
           top_ids: bytes) -> list[TokenInfo]:
    """Tokens from an output's packed arrays (alternatives: tokens x N, row-major). The
    prompt's first token, in the first output with prompt logprobs, has a NaN logprob, which
    becomes None, without alternatives."""
    values = np.frombuffer(logprobs, dtype=np.float32).tolist()
    count = len(values)
    width = len(top_texts) // count if count else 0
    top_lps = np.frombuffer(top_logprobs, dtype=np.float32).reshape(count, width).tolist()
    ids = np.frombuffer(top_ids, dtype=np.int32).reshape(count, width).tolist()
    return [TokenInfo(texts[i], None, [], []) if value != value  # NaN
            else TokenInfo(texts[i], value,
                           list(zip(top_texts[i * width:(i + 1) * width], top_lps[i], strict=True)),
                           ids[i])
            for i, value in enumerate(values)]


def completion_logprobs(tokens: list[TokenInfo], offset: int, top: bool) -> CompletionLogprobs:
    """The legacy completions shape; ``offset`` is where the first token's text starts."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    return CompletionLogprobs(
        tokens=[t.text for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[dict(t.top) if t.logprob is not None else None for t in tokens]
        if top else None,
        text_offset=offsets,
    )


def top_tokens(tokens: list[TokenInfo]) -> list[list[TopToken]] | None:
    """``/generate``'s alternatives by token id; None when none were asked for."""
    if not any(t.top for t in tokens):
        return None
    return [[TopToken(i, lp) for i, (_, lp) in zip(t.top_ids, t.top, strict=True)]
            for t in tokens]


def chat_logprobs(tokens: list[TokenInfo]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        TokenLogprob(t.text, t.logprob, list(t.text.encode()),
                     [TopLogprob(text, lp, list(text.encode())) for text, lp in t.top])
        for t in tokens
    ])


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended it, if one did
    started: bool = False  # a stream has sent this choice's first chunk


class Choices:
    """Every choice of one API request, and its usage, folded from engine outputs."""

    def __init__(self, num_prompts: int, n: int, discard: bool = False) -> None:
        """``discard``: the generated tokens are dropped (``echo`` with ``max_tokens`` 0: the
        engine samples one token, which the response leaves out)."""
        self.n = n
        self.discard = discard
        self.choices = [Choice(i) for i in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        # by tier (None: the engine has no such tier)
        self.cached_tokens_host: list[int | None] = [None] * num_prompts
        self.cached_tokens_disk: list[int | None] = [None] * num_prompts
        self.prompt_texts = [""] * num_prompts
        self.prompt_infos: list[list[TokenInfo]] = [[] for _ in range(num_prompts)]

    def add(self, prompt_index: int, out: RequestOutput) -> tuple[Choice, list[int],
                                                                   list[TokenInfo]]:
        """Fold one output in; returns its choice and the output's own token ids and tokens."""
        self.prompt_tokens[prompt_index] = out.prompt_tokens or self.prompt_tokens[prompt_index]
        self.cached_tokens[prompt_index] = out.cached_tokens or self.cached_tokens[prompt_index]
        for tier, count in ((self.cached_tokens_host, out.cached_tokens_host),
                            (self.cached_tokens_disk, out.cached_tokens_disk)):
            if count is not None:
                tier[prompt_index] = max(count, tier[prompt_index] or 0)
        self.prompt_texts[prompt_index] += out.prompt_text
        if out.prompt_logprobs:
            self.prompt_infos[prompt_index] += prompt_token_infos(out)
        choice = self.choices[prompt_index * self.n + out.index]
        ids = unpack_ids(out.token_ids).tolist()
        tokens = token_infos(out)
        if self.discard:
            ids, tokens, out.text = [], [], ""
        if out.replace:
            choice.text, choice.token_ids, choice.tokens = "", [], []
        choice.text += out.text
        choice.token_ids += ids
        choice.tokens += tokens
        if out.finish_reason is not None:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason
        return choice, ids, tokens

    def echoed(self, choice: Choice, text: str, tokens: list[TokenInfo]
               ) -> tuple[str, list[TokenInfo]]:
        """``text`` and ``tokens`` of ``choice`` after its prompt's (``echo``)."""
        prompt = choice.index // self.n
        return self.prompt_texts[prompt] + text, self.prompt_infos[prompt] + tokens

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens)
        completion = self.completion_tokens
        return Usage(prompt, completion, prompt + completion,
                     PromptTokensDetails(sum(self.cached_tokens), _total(self.cached_tokens_host),
                                         _total(self.cached_tokens_disk)))


def _total(counts: list[int | None]):
    """The sum over prompts of one tier's cached tokens; unset when the engine has no such
    tier."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else UNSET
