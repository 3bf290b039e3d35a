"""The trace format: JSONL, one request a line, in the order the requests arrived.

Fields of a line (docs/profiler.md has examples)::

    id                  string (an integer is accepted and read as its decimal string)
    arrival             seconds since the trace began, >= 0
    prompt_token_ids    list of token ids          } exactly one of these three
    prompt              text, tokenized as-is      }
    messages            OpenAI chat messages       }
    output_token_ids    what the model said        } at least one; with both, the ids win
    max_tokens          output length only         }
    session_id          optional: a conversation, a tree, a user
    namespace           optional: tenant / LoRA / cache salt; namespaces never share cache

``read_requests`` reads a trace straight into ``ReplayRequest``s carrying prompt and output as int32
arrays, which is what the simulators replay: each line's token ids become an array as the line
is read, so the trace is never held as Python lists (145M token ids as lists take ~5 GB, as
int32 arrays 0.6 GB). ``read_trace`` keeps each line as written (``TraceRequest``, lists of
ids), for the live client that sends them; ``load_requests`` turns those into ``ReplayRequest``s.
Text prompts need a tokenizer (``load_tokenizer``): the transformers import is deferred to that
call, so a trace of token ids is replayed without it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

DEFAULT_VOCAB_SIZE = 32000


class TraceError(ValueError):
    """A trace line that does not follow the format; the message names the line."""


@dataclass
class TraceRequest:
    """One trace line, as written (text stays text). Token ids are lists, or int32 arrays where
    ``parse_line`` was asked for arrays."""

    id: str
    arrival: float
    prompt_token_ids: list[int] | np.ndarray | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    output_token_ids: list[int] | np.ndarray | None = None
    max_tokens: int | None = None
    session_id: str | None = None
    namespace: str | None = None

    @property
    def output_len(self) -> int:
        if self.output_token_ids is not None:
            return len(self.output_token_ids)
        return int(self.max_tokens or 0)

    def to_json(self) -> dict[str, Any]:
        """The line's fields, leaving out the ones that are unset."""
        fields = ("id", "arrival", "prompt_token_ids", "prompt", "messages", "output_token_ids",
                  "max_tokens", "session_id", "namespace")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


@dataclass
class ReplayRequest:
    """A request ready to replay: token ids for the prompt and for the output."""

    id: str
    arrival: float
    prompt: np.ndarray  # int32
    output: np.ndarray  # int32
    namespace: str | None = None
    session_id: str | None = None


def _ids(value: Any, field: str, where: str, as_array: bool) -> list[int] | np.ndarray:
    # Checked as one numpy array: a per-element Python check costs seconds on a large trace.
    try:
        array = np.asarray(value) if isinstance(value, list) else None
    except (OverflowError, ValueError):
        array = None
    if array is None or array.ndim != 1 or (array.size and (
        array.dtype.kind not in "iu" or array.min() < 0 or array.max() > np.iinfo(np.int32).max
    )):
        raise TraceError(f"{where}: {field} must be a list of non-negative integers")
    return array.astype(np.int32) if as_array else value


def parse_line(obj: Any, where: str, *, arrays: bool = False) -> TraceRequest:
    """Validate one decoded JSON line; errors say which line and which field is wrong. Token
    ids stay the lists they were decoded as, or become int32 arrays with ``arrays``."""
    if not isinstance(obj, Mapping):
        raise TraceError(f"{where}: a trace line must be a JSON object")
    unknown = set(obj) - set(TraceRequest.__dataclass_fields__)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "id" not in obj or not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        raise TraceError(f"{where}: every request needs an 'id' (a string)")
    arrival = obj.get("arrival")
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not (
        math.isfinite(arrival) and arrival >= 0
    ):
        raise TraceError(f"{where}: 'arrival' must be a number of seconds >= 0")
    given = [k for k in ("prompt_token_ids", "prompt", "messages") if obj.get(k) is not None]
    if len(given) != 1:
        raise TraceError(f"{where}: give exactly one of prompt_token_ids, prompt, messages "
                         f"(got {', '.join(given) or 'none'})")
    request = TraceRequest(id=str(obj["id"]), arrival=float(arrival))
    if given[0] == "prompt_token_ids":
        request.prompt_token_ids = _ids(obj["prompt_token_ids"], "prompt_token_ids", where,
                                        arrays)
        if not len(request.prompt_token_ids):
            raise TraceError(f"{where}: prompt_token_ids is empty")
    elif given[0] == "prompt":
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise TraceError(f"{where}: 'prompt' must be a non-empty string")
        request.prompt = obj["prompt"]
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
        ):
            raise TraceError(f"{where}: 'messages' must be a non-empty list of "
                             "{{role, content}} objects")
        request.messages = [dict(m) for m in messages]
    if obj.get("output_token_ids") is not None:
        request.output_token_ids = _ids(obj["output_token_ids"], "output_token_ids", where,
                                        arrays)
    if obj.get("max_tokens") is not None:
        max_tokens = obj["max_tokens"]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise TraceError(f"{where}: 'max_tokens' must be a positive integer")
        request.max_tokens = max_tokens
    if request.output_token_ids is None and request.max_tokens is None:
        raise TraceError(f"{where}: give output_token_ids or max_tokens")
    for key in ("session_id", "namespace"):
        if obj.get(key) is not None:
            setattr(request, key, str(obj[key]))
    return request


_decoder = msgspec.json.Decoder()


def jsonl_objects(path: str | Path) -> Iterator[tuple[Any, int, str]]:
    """Each non-blank line of a JSONL file decoded, with its number and ``path:number`` (for
    error messages).

    msgspec decodes (about 2.5x faster than ``json`` on lines of token ids); a line it refuses
    is decoded again by ``json``, whose verdict and messages stay the format's (it also takes
    the NaN and lone surrogates msgspec rejects)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = _decoder.decode(line)
            except msgspec.MsgspecError:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            yield obj, number, where


def arrival_order(requests: list, path: str | Path) -> list:
    """A trace's requests sorted by arrival (stable: equal times keep file order); a trace
    without any is an error."""
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return sorted(requests, key=lambda r: r.arrival)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace as written, sorted by arrival."""
    return arrival_order([parse_line(obj, where) for obj, _, where in jsonl_objects(path)], path)


def read_requests(path: str | Path, tokenizer: Any = None) -> list[ReplayRequest]:
    """Read a JSONL trace into ``ReplayRequest``s ready to replay, sorted by arrival. Token ids
    go into int32 arrays and text is tokenized as each line is read; a text prompt without a
    tokenizer is an error."""
    lines = (parse_line(obj, where, arrays=True) for obj, _, where in jsonl_objects(path))
    return arrival_order(load_requests(lines, tokenizer), path)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    """Write requests as JSONL; returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request.to_json(), ensure_ascii=False, separators=(",", ":")))
            f.write("\n")
            count += 1
    return count


def needs_tokenizer(requests: Iterable[TraceRequest]) -> bool:
    return any(r.prompt_token_ids is None for r in requests)


def load_tokenizer(source: str | Path) -> Any:
    """The tokenizer ``--tokenizer`` names, as ``--model`` takes a model: a Hugging Face
    directory (``tokenizer.json`` and its config), a .gguf file (its tokenizer, converted once
    into the same cached directory the server loads), or a directory holding one .gguf. A
    sentence (``ValueError``) when it holds no tokenizer."""
    # deferred: heavy, and unneeded for token-id traces
    from engine.checkpoints.gguf import find_gguf, gguf_checkpoint
    from engine.contracts.tokenizer import load_tokenizer as load_model_tokenizer

    path = Path(source)
    if not path.exists():
        raise ValueError(f"--tokenizer {source}: no such file or directory")
    gguf = find_gguf(path)
    directory = gguf_checkpoint(gguf) if gguf is not None else path
    try:
        return load_model_tokenizer(str(directory))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {source} holds no tokenizer that transformers can load "
                         "(a directory with tokenizer.json and tokenizer_config.json, or a "
                         f".gguf file): {str(exc).splitlines()[0]}") from exc


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if isinstance(ids, Mapping):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def pseudo_output(request_id: str, length: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> np.ndarray:
    """Output ids for a request that gives only ``max_tokens``: random, but fixed by its id,
    so every replay of the trace (and every cache size in a sweep) sees the same tokens."""
    seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, vocab_size, length, dtype=np.int32)


def prompt_ids(request: TraceRequest, tokenizer: Any = None) -> np.ndarray:
    """The prompt as int32 token ids, tokenizing text the way an OpenAI-compatible server does
    (completions: ``encode`` with special tokens; chat: the template plus a generation prompt)."""
    if request.prompt_token_ids is not None:
        return np.asarray(request.prompt_token_ids, dtype=np.int32)
    if tokenizer is None:
        raise TraceError(f"request {request.id!r} has a text prompt: pass --tokenizer DIR "
                         "to tokenize it")
    if request.prompt is not None:
        return np.asarray(tokenizer.encode(request.prompt), dtype=np.int32)
    return np.asarray(encode_chat(tokenizer, request.messages), dtype=np.int32)


def to_request(request: TraceRequest, tokenizer: Any = None,
               vocab_size: int = DEFAULT_VOCAB_SIZE) -> ReplayRequest:
    """One line tokenized for replay; its output comes from the line or from
    ``pseudo_output``."""
    if request.output_token_ids is not None:
        output = np.asarray(request.output_token_ids, dtype=np.int32)
    else:
        output = pseudo_output(request.id, request.output_len, vocab_size)
    return ReplayRequest(request.id, request.arrival, prompt_ids(request, tokenizer), output,
                         request.namespace, request.session_id)


def load_requests(trace: Iterable[TraceRequest], tokenizer: Any = None) -> list[ReplayRequest]:
    """Tokenize a trace read by ``read_trace`` (or its lines as they are read) for replay."""
    vocab_size = len(tokenizer) if tokenizer is not None else DEFAULT_VOCAB_SIZE
    return [to_request(r, tokenizer, vocab_size) for r in trace]
