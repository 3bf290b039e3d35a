"""Planning one step: which sequences run, how far each extends, who is admitted, who is
preempted. ``StepPlanner`` is a part the ``Scheduler`` owns: it holds the request queues
(running / waiting) and plans over the sequences' memory ``mem``, the radix ``tree`` and the
session pins; it ends no request itself (one it can never schedule comes back in the plan).

Order of a step: running requests first, most progress first, each sequence extending by one
decode token or a prefill chunk within the prefill budget; growth that finds no page preempts
the lower-progress requests (never beams), or the request itself (beams too: they wait and come
back whole); then, unless something was preempted, waiting requests by policy while the pages
(free + evictable, minus what running requests are expected to still need) and
``max_running_requests`` allow (and at most ``max_loras`` LoRA adapters per step: a request
whose adapter would be one more waits for a later step); last, speculative drafts for the decoding sequences, from the
pages still free once every sequence of the step has its own (so a draft never takes a page a
sequence planned after it needs: drafts never evict the cache or preempt anyone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.contracts.engine_config import EngineConfig
from engine.contracts.worker_messages import ModelInfo
from radix import Lease, OutOfPages, RadixTree
from scheduler.kv import SeqMemory, StepWork
from scheduler.policy import long_uncached, order_waiting, shared_head
from scheduler.request import Request, Seq, Status
from scheduler.session_pins import SessionPins
from scheduler.speculation import Speculator

logger = logging.getLogger("radixserve.scheduler")

NEW_TOKEN_RATIO = (0.7, 0.1, 0.002)  # start (and after a preemption), floor, decay per step


def is_placeholder(token: int) -> bool:
    """A sequence's token that a batch in flight is sampling (``-1 - row`` of that batch)."""
    return token < 0


@dataclass
class Entry:
    """One sequence's part of a planned step."""

    seq: Seq
    extend: int
    samples: int  # logits rows drawn for it: 0 mid-prefill, n for a fork, k + 1 to verify k
    end: int = 0  # the sequence's computed tokens once this step has run (set when sent;
    #               drafts not counted: verification adds those it accepts)
    token_index: int = -1  # where its sampled token goes in ``seq.tokens`` (its placeholder)
    drafts: list[int] = field(default_factory=list)  # draft tokens it verifies after its last
    model_drafts: bool = False  # the draft model makes them in the worker (placeholders here)
    prompt_rows: int = 0  # prompt positions whose logits it returns (prompt logprobs)


@dataclass
class Plan:
    """One planned step: what runs (``entries``; none when nothing can), the page work before
    it, and a request that can never be scheduled (the scheduler fails it)."""

    entries: list[Entry] = field(default_factory=list)
    work: StepWork = field(default_factory=StepWork)
    unschedulable: Request | None = None
    starved: bool = False  # a look-ahead plan skipped growth that needed a preemption


class StepPlanner:
    def __init__(self, config: EngineConfig, info: ModelInfo, mem: SeqMemory,
                 sessions: SessionPins, speculator: Speculator | None = None) -> None:
        self.config = config
        self.speculator = speculator
        self.info = info
        self.mem = mem
        self.tree: RadixTree = mem.tree
        self.sessions = sessions
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.carry = StepWork()  # swaps planned by a step that ran nothing, for the next
        self.new_token_ratio = NEW_TOKEN_RATIO[0]
        self.num_preemptions = 0
        self._lookahead = self._starved = False
        self._num_running = 0  # sequences running when this plan began (speculation reads it)
        self._adapters: set[int] = set()  # the LoRA adapters this plan's entries use

    def plan(self, lookahead: bool = False, admit: bool = True) -> Plan:
        """Plan the next step (its entries are empty when nothing can run). ``lookahead``: a
        batch is still in flight; sequences it ends for certain (at their length limit) are left
        out, and growth short of pages skips the sequence instead of preempting (``starved``).
        ``admit``: False leaves the waiting requests waiting (scheduler/refill.py)."""
        self._lookahead, self._starved = lookahead, False
        self._adapters = set()
        work, self.carry = self.carry, StepWork()
        entries: list[Entry] = []
        budget = self.config.max_prefill_tokens
        preempted: set[int] = set()
        order = sorted(self.running, key=lambda r: r.progress, reverse=True)
        self._num_running = sum(len(r.live_seqs()) for r in self.running)
        for position, req in enumerate(order):
            if id(req) in preempted or not self._adapter_fits(req):
                continue
            planned = self._plan_running(req, order, position, preempted, work, budget)
            if planned is None:
                continue
            entries.extend(planned)
            budget -= sum(e.extend for e in planned if e.extend > 1 and not e.drafts)
        decoding = [e for e in entries if e.extend == 1]
        blocked = None
        if preempted:
            self.new_token_ratio = NEW_TOKEN_RATIO[0]  # pages are short: no drafts either
        else:
            blocked = self._admit_waiting(entries, work, budget) if admit else None
            for entry in decoding:
                self._draft(entry, work)
        if entries:
            self.new_token_ratio = max(NEW_TOKEN_RATIO[1],
                                       self.new_token_ratio - NEW_TOKEN_RATIO[2])
            return Plan(entries, work, starved=self._starved)
        self.carry = work
        if not self.waiting or self.running or preempted:
            return Plan(starved=self._starved)
        if self.sessions.unpin_oldest():
            return Plan()  # pinned sessions give way before a request is refused
        if self._unswap_waiting():
            return Plan()  # swapped requests give their device pages back, then retry
        # Nothing runs and the request first in line cannot be admitted into a pool that nothing
        # else holds: it never will be (e.g. samples of a preempted n > 1 request whose diverged
        # KV outgrew the pool). It fails; the others go on.
        return Plan(unschedulable=blocked or self.waiting[0])

    def _adapter_fits(self, req: Request) -> bool:
        """Whether ``req``'s LoRA adapter may be in this step (taking a place if it is new):
        the worker holds ``max_loras`` adapters at once, and a step never swaps one out."""
        if not req.lora_id or req.lora_id in self._adapters:
            return True
        if len(self._adapters) >= self.info.max_loras:
            return False
        self._adapters.add(req.lora_id)
        return True

    def _plan_running(self, req: Request, order: list[Request], position: int,
                      preempted: set[int], work: StepWork, budget: int) -> list[Entry] | None:
        """Entries for ``req`` (``order[position]``)'s running sequences; None when it had to
        be preempted. It may preempt only requests after it in ``order`` (less progress)."""
        planned = []
        limit = req.max_len(self.info.context_len)
        for seq in req.live_seqs():
            if seq.status is not Status.RUNNING:
                continue
            if seq.remaining < 1 or (is_placeholder(seq.tokens[-1])
                                     and (len(seq.tokens) >= limit or seq.closing)):
                continue  # the batch in flight samples its last token, or runs its closing step
            extend = seq.remaining
            if extend > 1:
                extend = min(extend, self.config.chunked_prefill_size, budget)
                if extend <= 0:
                    continue
                budget -= extend
            grown = self._grow(seq, seq.computed + extend, order, position, preempted, work)
            if grown is None:
                continue  # look-ahead, short of pages
            if not grown:
                return None
            planned.append(Entry(seq, extend, self._samples_for(seq, extend)))
        return planned

    def _draft(self, entry: Entry, work: StepWork) -> None:
        """Turn a decode ``entry`` into a verification of draft tokens when its sequence drafts
        and the free pages (what the step's other sequences left) hold them."""
        seq, req = entry.seq, entry.seq.req
        if (self.speculator is None or req.is_beam or req.has_penalties or seq.closing
                or is_placeholder(seq.tokens[-1]) or entry.samples != 1):
            return
        drafts, by_model = self.speculator.plan(seq, req.max_len(self.info.context_len),
                                                self._num_running)
        if not drafts:
            return
        upto = seq.computed + 1 + len(drafts)
        need = self.mem.alloc.pages_for(upto) - len(seq.pages) + seq.copy_last_page
        sliding = self.tree.sliding  # each fresh page takes a sliding page, none evicted
        if need > self.mem.alloc.num_free_pages or (
                sliding is not None and need > sliding.allocator.num_free_pages):
            return
        self.mem.grow(seq, upto, work)
        entry.extend = entry.samples = 1 + len(drafts)
        entry.drafts, entry.model_drafts = drafts, by_model

    def _grow(self, seq: Seq, upto: int, order: list[Request], position: int,
              preempted: set[int], work: StepWork) -> bool | None:
        """Pages for ``upto`` tokens, preempting lower-progress requests; False when the
        sequence's own request had to go, None when a look-ahead plan skips it."""
        req = order[position]
        while True:
            try:
                self.mem.grow(seq, upto, work)
                return True
            except OutOfPages:
                if self._lookahead:
                    self._starved = True
                    return None
                victim = next((r for r in reversed(order[position + 1 :])
                               if id(r) not in preempted and not r.is_beam and r.live_seqs()),
                              None)
                if victim is None:
                    self._preempt(req, work)  # beams too: all of them wait together
                    preempted.add(id(req))
                    return False
                self._preempt(victim, work)
                preempted.add(id(victim))

    def _samples_for(self, seq: Seq, extend: int) -> int:
        if seq.closing or seq.computed + extend < len(seq.tokens):
            return 0  # a prefill chunk that does not reach the end yet, or a session's last token
        req = seq.req
        if not req.forked and req.params.n > 1 and not req.is_beam:
            return req.params.n
        return 1

    def _admit_waiting(self, entries: list[Entry], work: StepWork, budget: int) -> Request | None:
        """Admit waiting requests by policy; returns the one that stopped admission, if any."""
        num_running = sum(len(r.live_seqs()) for r in self.running)
        reserved = sum(self._request_reserve(r) for r in self.running)
        # A request whose head (first SHARED_HEAD prompt tokens) another request is prefilling
        # right now waits: once that prefill is in the tree it hits all of it, instead of
        # computing its own copy of the rest (and holding private pages for it).
        busy_heads = {self._head(r) for r in self.running
                      if (r.seqs[0].computed < r.prompt_len or r.seqs[0].prefills_in_flight)
                      and long_uncached(r.prompt_len, r.cached_tokens)}
        busy_heads.discard(None)
        # A session's next turn waits while its previous turn's closing step runs: the history
        # reaches the tree when that step comes back (only a look-ahead plan can see both).
        closing = {r.session_id for r in self.running
                   if r.session_id is not None and any(s.closing for s in r.live_seqs())}
        for req in order_waiting(self.waiting, self.config.policy, self.tree):
            seqs = req.live_seqs()
            width = len(seqs) if req.forked else max(req.params.n, req.params.beam_width)
            if num_running + width > self.config.max_running_requests or budget <= 0:
                return req
            if req.session_id in closing or self.sessions.parents.get(req.session_id) in closing:
                continue
            head = self._head(req)
            if head is not None and head in busy_heads and long_uncached(
                    req.prompt_len, self.tree.peek_prefix(req.seqs[0].tokens, req.namespace)):
                continue
            if not self._adapter_fits(req):
                continue
            admitted = self._admit(req, seqs, work, budget, reserved)
            if admitted is None:
                return req
            entries.extend(admitted)
            if head is not None and long_uncached(req.prompt_len, req.cached_tokens):
                busy_heads.add(head)
            budget -= sum(e.extend for e in admitted)
            num_running += width
            reserved += self._request_reserve(req)
            self.waiting.remove(req)
            self.running.append(req)
        return None

    @staticmethod
    def _head(req: Request) -> tuple | None:
        if req.wants_prompt_logprobs:
            return None  # it computes its whole prompt: waiting for a shared head gains nothing
        return shared_head(req.seqs[0].tokens, req.namespace, req.prompt_len)

    def _request_reserve(self, req: Request) -> int:
        """Pages ``req`` is expected to still need: every sequence it has or will fork into
        (``n`` samples, ``beam_width`` beams) grows to ``max_tokens``, and each fork first
        copies the partial page it shares."""
        ratio = 1.0 if req.is_beam else self.new_token_ratio
        params, page_size = req.params, self.info.page_size
        width = max(params.n, params.beam_width)
        if req.forked:
            lefts, forks = [params.max_tokens - s.num_outputs for s in req.live_seqs()], 0
        else:
            lefts, forks = [params.max_tokens] * width, width - 1
        return int(ratio * sum(lefts) / page_size) + forks

    def _admit(self, req: Request, seqs: list[Seq], work: StepWork, budget: int,
               reserved: int) -> list[Entry] | None:
        if req.seqs[0].host_pages or any(s.host_pages for s in seqs):
            return self._admit_swapped(req, seqs, work, reserved)
        matches, need, windows = [], 0, 0
        loading: set = set()  # host-tier nodes the samples before this one will load
        waits: set[int] = set()  # sequences that wait for a load into their own pages
        for seq in seqs:
            lease = self.mem.match(seq, disk=not req.forked)
            extend = len(seq.tokens) - lease.length
            if not req.forked and (seq.disk_names or self.mem.loads_host_part(seq)):
                waits.add(id(seq))
                extend = 0  # pages for what it loads now, the rest once it has arrived
            elif not (req.is_beam and req.forked):
                # Beams come back whole: every beam must reach its next sample in the same step
                # (a beam step ranks them all together), and each mostly hits the shared prompt.
                extend = min(extend, self.config.chunked_prefill_size, max(budget, 1))
            budget -= extend
            matches.append((seq, extend))
            pages, sliding = self._acquire_needs(
                lease, lease.length + extend + self.mem.disk_tokens(seq), loading,
                self.mem.reads_from(seq))
            need, windows = need + pages, windows + sliding
        if need + reserved + self._request_reserve(req) > self.tree.num_available_pages and (
            self.running or need > self.tree.num_available_pages
        ) or self._short_of_sliding(windows, len(seqs)):
            for seq, _ in matches:
                self.mem.unpin(seq)
                seq.disk_names = []
            return None
        admitted = []
        for seq, extend in matches:
            if id(seq) in waits:
                self.mem.take_match(seq, seq.lease.length + self.mem.disk_tokens(seq), work,
                                    wait=True)
                # no entry until its load has ended; none this step either when another
                # sequence loaded its host part meanwhile (it runs from the next plan on)
                seq.status = Status.LOADING if seq.load_id >= 0 else Status.RUNNING
                continue
            self.mem.take_match(seq, seq.lease.length + extend, work)
            seq.status = Status.RUNNING
            admitted.append(Entry(seq, extend, self._samples_for(seq, extend)))
        if req.cached_tokens < 0:
            match = matches[0][0].lease.match
            req.cached_tokens, req.cached_tokens_host = match.length, match.host_length
        return admitted

    def _acquire_needs(self, lease: Lease, num_tokens: int, loading: set,
                       reads_from: int | None = None) -> tuple[int, int]:
        """Fresh pages ``lease.acquire(num_tokens, reads_from=...)`` takes (adding its loads to
        ``loading``), and of them those that take sliding pages."""
        before = set(loading) if self.tree.sliding is not None else loading
        pages = lease.pages_to_acquire(num_tokens, loading)
        if self.tree.sliding is None:
            return pages, pages
        return pages, lease.pages_to_acquire(num_tokens, before, windows=True,
                                             reads_from=reads_from)

    def _short_of_sliding(self, need: int, width: int) -> bool:
        """With sliding-window layers: every fresh page takes a sliding page too, and each
        running sequence may need one more as its window moves on."""
        sliding = self.tree.sliding
        if sliding is None:
            return False
        available = sliding.num_available_pages
        return need > available or bool(self.running) and (
            need + width + self._num_running > available)

    def _admit_swapped(self, req: Request, seqs: list[Seq], work: StepWork,
                       reserved: int) -> list[Entry] | None:
        """Bring a swapped request back whole. Its sequences that had no private page to swap
        were released into the tree at preemption: they match it again (usually a full hit)."""
        released = [s for s in seqs if not s.host_pages and not s.pages]
        swapped = [s for s in seqs if s.host_pages or s.pages]
        need = sum(self.mem.pages_to_resume(s) for s in swapped)
        windows = sum(self.mem.sliding_to_resume(s) for s in swapped) if self.tree.sliding else 0
        loading: set = set()
        for seq in released:
            pages, sliding = self._acquire_needs(self.mem.match(seq), len(seq.tokens), loading)
            need, windows = need + pages, windows + sliding
        if need + (reserved if self.running else 0) > self.tree.num_available_pages or (
                self._short_of_sliding(windows, len(seqs))):
            for seq in released:
                self.mem.unpin(seq)
            return None
        admitted = []
        for seq in seqs:
            if seq in released:
                self.mem.take_match(seq, len(seq.tokens), work)
            else:
                self.mem.swap_in(seq, work)
                self.mem.grow(seq, seq.computed + seq.remaining, work)
            seq.status = Status.RUNNING
            admitted.append(Entry(seq, seq.remaining, self._samples_for(seq, seq.remaining)))
        return admitted

    def _unswap_waiting(self) -> bool:
        """Nothing runs and nothing can be admitted: swapped-out requests still hold the device
        pages they shared, and may be what keeps each other out. They drop everything (their
        shared prefix stays cached in the tree) and will be recomputed. False if none held a
        device page."""
        released = False
        for req in self.waiting:
            for seq in req.live_seqs():
                if seq.host_pages or any(p >= 0 for p in seq.pages):
                    self.mem.release(seq, cache=False)
                    seq.status = Status.WAITING
                    released = True
        return released

    def admit_again(self, req: Request) -> None:
        """``req`` (running or loading) drops its pages and waits to be admitted again."""
        for seq in req.live_seqs():
            self.mem.release(seq, cache=False)
            seq.status = Status.WAITING
        self.running.remove(req)
        self.waiting.append(req)

    def _preempt(self, req: Request, work: StepWork) -> None:
        self.num_preemptions += 1
        swap = self.config.preemption_mode == "swap"
        for seq in req.live_seqs():
            self.mem.unplan_copies(seq, work)
            if not (swap and self.mem.swap_out(seq, work)):
                self.mem.release(seq, cache=True)
            seq.status = Status.SWAPPED if seq.host_pages else Status.WAITING
        logger.info("preempted %s (%s)", req.rid, "swap" if swap else "recompute")
        self.running.remove(req)
        self.waiting.append(req)
