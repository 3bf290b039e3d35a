"""Mooncake's public trace format (kvcache-ai/Mooncake, FAST'25), read natively.

One request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds; ``hash_ids`` has one id per ``block_tokens``-token
block of the prompt (512 in Mooncake's releases), the last block possibly partial. Two prompts
share a block id exactly where they share that whole block and everything before it.

Prompts and outputs become token ids as block_trace.py describes: each block as
``block_tokens`` copies of its hash id, so the token-granular replay finds exactly the leading
whole blocks two prompts share; each output gets its own id, matching no prompt. Nothing is
written out; the arrays are built in memory line by line.
"""

from __future__ import annotations

from pathlib import Path

from engine.profiler.block_trace import (
    BlockPrompt,
    count_field,
    json_objects,
    prompt_blocks,
    to_requests,
)
from engine.profiler.trace import ReplayRequest

MOONCAKE_BLOCK_TOKENS = 512


def read_mooncake(path: str | Path,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[ReplayRequest]:
    """Requests of a Mooncake-format trace, in arrival order (stable)."""
    if block_tokens < 1:
        raise ValueError(f"--block-tokens must be at least 1, got {block_tokens}")
    prompts = []
    for obj, number, where in json_objects(path):
        length, hashes = prompt_blocks(obj, where, block_tokens)
        prompts.append(BlockPrompt(f"line-{number}", count_field(obj, "timestamp", where) / 1000.0,
                                   length, hashes, count_field(obj, "output_length", where)))
    return to_requests(prompts, block_tokens, path)
