"""Traces that give each prompt as hash ids of fixed-size token blocks (Mooncake, Bailian): the
line checks and the expansion into token ids that every such format shares.

A prompt of ``input_length`` tokens has one hash id per ``block_tokens``-token block, the last
block possibly partial::

    hash_ids     [  46  |  47  |  9 ]          block_tokens = 4, input_length = 10
    prompt       46 46 46 46 47 47 47 47 9 9   each block as copies of its id, cut to the length

Equal hash prefixes are then equal token prefixes, and two prompts first differ at the first
token of their first differing block, so the token-granular replay finds exactly the leading
whole blocks two prompts share (and, for a last partial block, the tokens both have of it).
Reuse inside a block the trace hashes differently is invisible to any cache replaying it.

Outputs are not hashed in these formats: each request's output gets its own id above every
hash id, so no prompt ever matches a reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.profiler.trace import ReplayRequest, TraceError, arrival_order, jsonl_objects

_INT32_MAX = int(np.iinfo(np.int32).max)
# Hash ids stay below half of int32 so the output ids above them fit too.
HASH_ID_LIMIT = _INT32_MAX // 2


@dataclass
class BlockPrompt:
    """One line of a block-hash trace, checked; ``hash_ids`` is int64."""

    id: str
    arrival: float
    input_length: int
    hash_ids: np.ndarray
    output_length: int
    session_id: str | None = None


def json_objects(path: str | Path) -> Iterator[tuple[dict[str, Any], int, str]]:
    """``jsonl_objects`` whose every line must be a JSON object."""
    for obj, number, where in jsonl_objects(path):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a line must be a JSON object")
        yield obj, number, where


def count_field(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {name} must be a non-negative integer")
    return value


def prompt_blocks(obj: dict[str, Any], where: str, block_tokens: int) -> tuple[int, np.ndarray]:
    """``input_length`` and ``hash_ids`` (int64), checked against each other."""
    length = count_field(obj, "input_length", where)
    value = obj.get("hash_ids")
    # One numpy conversion checks every id at once: ints give an integer dtype, while a float,
    # string or out-of-range int anywhere gives another kind (or raises). Only bools among ints
    # convert silently; the type scan that catches them runs in C.
    try:
        hashes = np.asarray(value) if isinstance(value, list) else None
    except (OverflowError, ValueError):
        hashes = None
    if (hashes is None or hashes.ndim != 1 or (hashes.size and hashes.dtype.kind not in "iu")
            or bool in map(type, value)):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    hashes = hashes.astype(np.int64)
    if len(hashes) != -(-length // block_tokens) or length == 0:
        raise TraceError(
            f"{where}: {len(hashes)} hash_ids for input_length {length} does not fit "
            f"{block_tokens}-token blocks (the last may be partial); is --block-tokens "
            "the trace's block size?")
    if hashes.min() < 0 or hashes.max() >= HASH_ID_LIMIT:
        raise TraceError(f"{where}: hash_ids must lie in [0, {HASH_ID_LIMIT})")
    return length, hashes


def to_requests(prompts: list[BlockPrompt], block_tokens: int,
                path: str | Path) -> list[ReplayRequest]:
    """Requests in arrival order (stable), each block as ``block_tokens`` copies of its id."""
    prompts = arrival_order(prompts, path)
    first_output_id = max(int(p.hash_ids.max()) for p in prompts) + 1
    requests = []
    for index, p in enumerate(prompts):
        prompt = np.repeat(p.hash_ids.astype(np.int32), block_tokens)[:p.input_length]
        output = np.full(p.output_length, min(first_output_id + index, _INT32_MAX),
                         dtype=np.int32)
        requests.append(ReplayRequest(p.id, p.arrival, prompt, output, session_id=p.session_id))
    return requests
