"""Alibaba Bailian's public trace format (alibaba-edu/qwen-bailian-usagetraces-anon, from the
USENIX ATC'25 paper "KVCache Cache in the Wild"), read natively.

One request a line::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

``timestamp`` is the arrival in seconds; ``hash_ids`` has one id per 16-token block of the
prompt (salted SipHash, remapped to integers), the last block possibly partial. Prompts and
outputs become token ids as block_trace.py describes. ``type`` and ``turn`` are not read.

Sessions: ``parent_chat_id`` names the request a turn follows (-1 for a first turn), so the
requests form trees; a request's session is the ``chat_id`` at the root of its chain, and a
parent that is not in the trace starts a session too::

    chat 7 (parent -1)  <-  chat 9 (parent 7)  <-  chat 12 (parent 9)     session "7"
    chat 30 (parent 4, not in the trace)  <-  chat 31 (parent 30)         session "30"

There are no namespaces: every request may share cache with every other.
"""

from __future__ import annotations

import math
from pathlib import Path

from engine.profiler.block_trace import (
    BlockPrompt,
    count_field,
    json_objects,
    prompt_blocks,
    to_requests,
)
from engine.profiler.trace import ReplayRequest, TraceError

BAILIAN_BLOCK_TOKENS = 16


def _parent(obj: dict, where: str) -> int:
    value = obj.get("parent_chat_id")
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise TraceError(f"{where}: parent_chat_id must be a chat_id or -1")
    return value


def _seconds(obj: dict, where: str) -> float:
    value = obj.get("timestamp")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
        math.isfinite(value) and value >= 0
    ):
        raise TraceError(f"{where}: timestamp must be a number of seconds >= 0")
    return float(value)


def session_roots(parents: dict[int, int], wheres: dict[int, str]) -> list[int]:
    """The root ``chat_id`` of each request's ``parent_chat_id`` chain, in the order of
    ``parents`` (chat_id -> parent_chat_id)."""
    roots: dict[int, int] = {}
    for start in parents:
        chain: dict[int, None] = {}  # ordered, and a set for the loop check
        at = start
        while at not in roots:  # each request is walked once: resolved chains stop the walk
            chain[at] = None
            parent = parents[at]
            if parent not in parents:
                roots[at] = at
            elif parent in chain:
                raise TraceError(f"{wheres[start]}: the parent_chat_id chain of chat_id "
                                 f"{start} loops back on itself")
            else:
                at = parent
        for chat in chain:
            roots[chat] = roots[at]
    return [roots[chat] for chat in parents]


def read_bailian(path: str | Path, block_tokens: int = BAILIAN_BLOCK_TOKENS) -> list[ReplayRequest]:
    """Requests of a Bailian-format trace, in arrival order (stable), with their sessions."""
    if block_tokens < 1:
        raise ValueError(f"--block-tokens must be at least 1, got {block_tokens}")
    prompts: list[BlockPrompt] = []
    parents: dict[int, int] = {}  # chat_id -> parent_chat_id
    seen: dict[int, str] = {}  # chat_id -> its line
    for obj, _, where in json_objects(path):
        chat_id = count_field(obj, "chat_id", where)
        if chat_id in seen:
            raise TraceError(f"{where}: chat_id {chat_id} was already used at {seen[chat_id]}")
        seen[chat_id] = where
        parents[chat_id] = _parent(obj, where)
        length, hashes = prompt_blocks(obj, where, block_tokens)
        prompts.append(BlockPrompt(str(chat_id), _seconds(obj, where), length, hashes,
                                   count_field(obj, "output_length", where)))
    roots = session_roots(parents, seen)
    for prompt, root in zip(prompts, roots, strict=True):
        prompt.session_id = str(root)
    return to_requests(prompts, block_tokens, path)
