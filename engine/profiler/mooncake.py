"""Mooncake's public trace format (kvcache-ai/Mooncake, FAST'25), read natively.

One request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds; ``hash_ids`` has one id per ``block_tokens``-token
block of the prompt (512 in Mooncake's releases), the last block possibly partial. Two prompts
share a block id exactly where they share that whole block and everything before it.

Each block becomes ``block_tokens`` copies of its hash id, cut to ``input_length`` at the end:
equal hash prefixes are then equal token prefixes, and two prompts first differ at the first
token of their first differing block, so the token-granular replay finds exactly the leading
whole blocks two prompts share (and, for the last partial block, the tokens both have of it).
Outputs are not hashed in the format: each request's output gets ids above every hash id, its
own, so no prompt ever matches a reply. Nothing is written out; the arrays are built in memory
line by line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engine.profiler.trace import Request, TraceError

MOONCAKE_BLOCK_TOKENS = 512
_INT32_MAX = int(np.iinfo(np.int32).max)


def _field(obj: dict, name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {name} must be a non-negative integer")
    return value


def read_mooncake(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[Request]:
    """Requests of a Mooncake-format trace, in arrival order (stable)."""
    if block_tokens < 1:
        raise ValueError(f"--block-tokens must be at least 1, got {block_tokens}")
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: a line must be a JSON object")
            length = _field(obj, "input_length", where)
            hashes = np.asarray(obj.get("hash_ids"), dtype=object)
            if hashes.ndim != 1 or not all(isinstance(h, int) and not isinstance(h, bool)
                                           for h in hashes):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            hashes = hashes.astype(np.int64)
            if len(hashes) != -(-length // block_tokens) or length == 0:
                raise TraceError(
                    f"{where}: {len(hashes)} hash_ids for input_length {length} does not fit "
                    f"{block_tokens}-token blocks (the last may be partial); is --block-tokens "
                    "the trace's block size?")
            if hashes.size and (hashes.min() < 0 or hashes.max() >= _INT32_MAX // 2):
                raise TraceError(f"{where}: hash_ids must lie in [0, {_INT32_MAX // 2})")
            lines.append((_field(obj, "timestamp", where) / 1000.0, length, hashes,
                          _field(obj, "output_length", where), str(number)))
    if not lines:
        raise TraceError(f"{path}: the trace has no requests")
    first_output_id = max(int(h.max()) for _, _, h, _, _ in lines) + 1
    lines.sort(key=lambda line: line[0])
    requests = []
    for index, (arrival, length, hashes, output_len, line_id) in enumerate(lines):
        prompt = np.repeat(hashes.astype(np.int32), block_tokens)[:length]
        output_id = min(first_output_id + index, _INT32_MAX)
        output = np.full(output_len, output_id, dtype=np.int32)
        requests.append(Request(f"line-{line_id}", arrival, prompt, output))
    return requests
