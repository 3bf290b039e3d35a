"""A step's result read row by row, and the outputs the scheduler queues for the tokenizers.

``SampledRows`` decodes a ``BatchResult``'s arrays once: the token each row sampled, its
logprob and top alternatives, the tokens its grammar forced after it and whether its grammar
ended. ``Outputs`` holds the ``SeqOutput``s per reply address until the process loop sends
them.
"""

from __future__ import annotations

import numpy as np

from engine.contracts.protocol import SeqOutput, pack_ids, unpack_ids
from engine.contracts.worker_messages import BatchResult
from scheduler.request import Request, Status


class SampledRows:
    def __init__(self, result: BatchResult) -> None:
        self.tokens = unpack_ids(result.token_ids)
        self.logprobs = np.frombuffer(result.logprobs, dtype=np.float32)
        self.top_ids = self.top_lps = None
        if result.top_n:
            self.top_ids = unpack_ids(result.top_ids).reshape(-1, result.top_n)
            self.top_lps = np.frombuffer(result.top_logprobs, dtype=np.float32).reshape(
                -1, result.top_n)
        self.forced = _forced_tokens(result, len(self.tokens))
        self.grammar_ended = set(unpack_ids(result.grammar_ended).tolist())
        # the draft model's drafts, for the entries that asked for them (engine/worker/draft.py)
        self.draft_counts = unpack_ids(result.draft_counts)
        self.draft_ids = unpack_ids(result.draft_ids)
        self.grammar_drafts = unpack_ids(result.grammar_drafts)  # kept under a grammar

    def after(self, row: int) -> list[int]:
        """Row ``row``'s sample followed by the tokens its grammar forced."""
        return [int(self.tokens[row]), *self.forced.get(row, ())]

    def logprob_bytes(self, start: int, end: int, want: int | None) -> tuple[bytes, bytes, bytes]:
        """Rows ``[start, end)``'s logprobs and their ``want`` top alternatives (ids, logprobs),
        as a ``SeqOutput`` carries them; empty where the request asked for none."""
        if want is None:
            return b"", b"", b""
        lp = self.logprobs[start:end].tobytes()
        if not want or self.top_ids is None:
            return lp, b"", b""
        return (lp, self.top_ids[start:end, :want].astype(np.int32).tobytes(),
                self.top_lps[start:end, :want].astype(np.float32).tobytes())


class Outputs:
    """``SeqOutput``s per reply address, oldest first; the tier counts go out only where the
    tier is on."""

    def __init__(self, *, host_tier: bool, disk_tier: bool) -> None:
        self.queued: dict[int, list[SeqOutput]] = {}
        self.host_tier, self.disk_tier = host_tier, disk_tier

    def emit(self, req: Request, index: int, tokens: list[int], *, finish_reason=None,
             error=None, status: int = 200, logprobs=b"", top_ids=b"", top_logprobs=b"",
             replace: bool = False) -> None:
        self.queued.setdefault(req.reply_to, []).append(SeqOutput(
            req.rid, index, pack_ids(tokens), logprobs, top_ids, top_logprobs, finish_reason,
            error, status, req.prompt_len, max(req.cached_tokens, 0), replace,
            cached_tokens_host=req.cached_tokens_host if self.host_tier else None,
            cached_tokens_disk=req.cached_tokens_disk if self.disk_tier else None,
        ))

    def prompt_logprobs(self, entries: list, result: BatchResult) -> None:
        """Each entry's prompt logprobs (the rows ``build_batch`` asked for, in entry order) go
        out as an output of sample 0 holding only them."""
        if not result.prompt_logprobs:
            return
        logprobs = np.frombuffer(result.prompt_logprobs, dtype=np.float32)
        width = len(result.prompt_top_ids) // 4 // len(logprobs)
        top_ids = unpack_ids(result.prompt_top_ids).reshape(len(logprobs), width)
        top_lps = np.frombuffer(result.prompt_top_logprobs, dtype=np.float32).reshape(
            len(logprobs), width)
        row = 0
        for entry in entries:
            n = entry.prompt_rows
            if not n:
                continue
            req = entry.seq.req
            want = req.params.prompt_logprobs
            if entry.seq.status is Status.RUNNING:
                req.prompt_logits_done += n
                self.queued.setdefault(req.reply_to, []).append(SeqOutput(
                    req.rid, 0, b"", prompt_tokens=req.prompt_len,
                    prompt_logprobs=logprobs[row : row + n].tobytes(),
                    prompt_top_ids=top_ids[row : row + n, :want].astype(np.int32).tobytes(),
                    prompt_top_logprobs=top_lps[row : row + n, :want].astype(
                        np.float32).tobytes()))
            row += n

    def take(self) -> dict[int, list[SeqOutput]]:
        out, self.queued = self.queued, {}
        return out


def _forced_tokens(result: BatchResult, num_rows: int) -> dict[int, list[int]]:
    """The tokens each constrained row's grammar forced after its sample (row -> tokens)."""
    if not result.forced_counts:
        return {}
    counts = unpack_ids(result.forced_counts)
    ids = unpack_ids(result.forced_ids).tolist()
    if len(counts) != num_rows or int(counts.sum()) != len(ids):
        raise ValueError(f"batch {result.batch_id}'s forced tokens do not match its rows")
    ends = np.cumsum(counts).tolist()
    return {row: ids[end - n : end] for row, (n, end) in enumerate(zip(counts.tolist(), ends,
                                                                          strict=True)) if n}
