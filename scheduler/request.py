"""Request and sequence state, owned by the scheduler.

A request runs one sequence until its prompt is prefilled; ``n > 1`` then forks it into ``n``
samples and beam search into ``beam_width`` beams. Every sequence holds its own references to
the pages of its table, so siblings share prefix pages through refcounts::

    positions   0 ............ cached ............ computed ........ len(tokens)
    sequence    [ matched in the tree | computed here | sampled, not yet run ]
    pages       [ shared: refcount > 1 ][ private ... ][last, maybe partial ]

``computed`` advances when a batch is sent and ``settled`` when it comes back: with overlap
scheduling one batch may be in flight, and the token it samples is a placeholder (``-1 - row``)
at the end of ``tokens`` until then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from engine.contracts.sampling_params import SamplingParams
from radix import Lease
from scheduler.drafting import ModelDrafts


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holding no pages
    RUNNING = "running"
    SWAPPED = "swapped"  # private pages on the host pool, waiting to come back
    LOADING = "loading"  # admitted, waiting for its prompt's KV from a tier (scheduler/loads.py)
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    req: Request
    index: int  # sample / beam number within the request
    tokens: list[int]  # prompt then outputs; the last one is not yet in the KV while decoding
    pages: list[int] = field(default_factory=list)  # one reference each, position order
    computed: int = 0  # tokens whose KV sits in ``pages`` once the batches sent have run
    settled: int = 0  # of those, the ones whose batch came back: all the tree may be given
    lease: Lease | None = None  # its hold on the tree: the path it pins (match, then commits)
    pending_refs: list[int] = field(default_factory=list)  # copy sources, held until the copy ran
    host_pages: list[tuple[int, int]] = field(default_factory=list)  # (page index, host page)
    cum_logprob: float = 0.0  # beam search
    status: Status = Status.WAITING
    finish_reason: str | None = None
    closing: bool = False  # a session turn's last token runs for its KV; no more samples
    copy_last_page: bool = False  # a fork's last page is its parent's, until grow() copies it
    prefills_in_flight: int = 0  # batches in flight prefilling a chunk of it (not in the tree yet)
    # speculative decoding (scheduler/speculation.py): its drafts accepted and tried (decayed
    # counts), decode steps left without drafting, the next such pause's length, and whether
    # the pause ended (one draft then, as a probe)
    draft_hits: float = 0.0
    draft_tries: float = 0.0
    draft_pause: int = 0
    draft_backoff: int = 4
    draft_probe: bool = False
    model_drafts: ModelDrafts = field(default_factory=ModelDrafts)  # the draft model's record
    # a load into its own pages in flight (scheduler/loads.py; -1: none); the disk tier's
    # blocks found to load at admission, and the tokens whose blocks were sent to be saved
    load_id: int = -1
    disk_names: list[str] = field(default_factory=list)
    disk_saved: int = 0
    # where a disk load of its that ended early stopped (its lookups stay below: a file that
    # fails every read is not loaded again and again; None: none did)
    disk_reach: int | None = None

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.req.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.tokens) - self.computed

    def ending(self, token: int, length: int, eos_ids: set[int],
               context_len: int) -> str | None:
        """Why it ends with ``token`` as its ``length``-th token, if it does."""
        p = self.req.params
        if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if length >= self.req.max_len(context_len):
            return "length"
        return None

    def first_ending(self, new: list[int], length: int, eos_ids: set[int],
                     context_len: int) -> tuple[int, str | None]:
        """The first of ``new`` (its tokens number ``length``, ``length + 1``, ...) that ends
        it and why, as ``ending`` of each in turn would say; the last index and None when none
        does."""
        p = self.req.params
        stops = [*p.stop_token_ids, *(() if p.ignore_eos else eos_ids)]
        hits = np.flatnonzero(np.isin(new, stops)) if stops else ()
        stop = int(hits[0]) if len(hits) else len(new)
        limit = max(self.req.max_len(context_len) - length, 0)
        if stop < len(new) and stop <= limit:
            return stop, "stop"
        if limit < len(new):
            return limit, "length"
        return len(new) - 1, None


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: np.ndarray
    params: SamplingParams
    reply_to: int
    namespace: str | None
    arrival: float
    session_id: str | None = None
    seqs: list[Seq] = field(default_factory=list)
    cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    cached_tokens_host: int = 0  # of those, found only in the host tier (and loaded)
    cached_tokens_disk: int = 0  # of those, loaded from the disk tier
    forked: bool = False
    finished_beams: list[tuple[float, list[int]]] = field(default_factory=list)
    peeked_prefix: int = 0  # the policy's last estimate of the cached prefix
    # prompt_logprobs: prompt positions whose logits have been computed (each gives the next
    # prompt token's logprob); only those may come from the cache when it is admitted again
    prompt_logits_done: int = 0
    # its LoRA adapter's id (0: the base model); ``namespace`` then includes the adapter
    lora_id: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.params.prompt_logprobs is not None
                and self.prompt_logits_done < self.prompt_len - 1)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_beam(self) -> bool:
        return self.params.beam_width > 1

    def max_len(self, context_len: int) -> int:
        """Tokens a sequence of this request may reach: prompt + max_tokens, within the context."""
        return min(self.prompt_len + self.params.max_tokens, context_len)

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalties: its sampler reads the whole history."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)

    def live_seqs(self) -> list[Seq]:
        return [s for s in self.seqs if s.status is not Status.FINISHED]

    @property
    def progress(self) -> tuple[int, float]:
        """Preemption order: the least generated output, then the latest arrival, goes first."""
        return (max((s.num_outputs for s in self.seqs), default=0), -self.arrival)
