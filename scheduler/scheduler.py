"""The scheduler: continuous batching over the radix cache, no sockets (see ``process.py``).

One step: ``schedule()`` plans a batch (running sequences first, most progress first, each
extending by one decode token or a prefill chunk; then waiting requests admitted by policy
within the token budget), the worker runs it, ``process_result()`` appends the sampled tokens,
forks samples and beams, finishes sequences and queues outputs. When decode runs out of pages,
the request with the least progress is preempted (recompute: its KV goes into the tree; swap:
its private pages go to the host pool). A session's turn runs one extra step after its last
sample, so the next turn's prompt (this whole sequence plus the new messages) is cached to its
last token, and its history stays pinned for the session's ttl (``scheduler/session_pins.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from engine.contracts.disk_blocks import DiskView
from engine.contracts.engine_config import EngineConfig
from engine.contracts.lora import lora_namespace
from engine.contracts.protocol import (
    LoraUpdate,
    LoraUpdated,
    SeqOutput,
    TokenizedRequest,
    unpack_ids,
)
from engine.contracts.worker_messages import BatchResult, ForwardBatch, ModelInfo
from radix import HostTier, PageAllocator, RadixTree
from radix.eviction import POLICIES
from scheduler.adapters import Adapters
from scheduler.admission import reject_reason
from scheduler.batch import build_batch
from scheduler.disk import DiskTier
from scheduler.forking import Forking
from scheduler.kv import SeqMemory, sliding_pages
from scheduler.loads import PendingLoads
from scheduler.outputs import Outputs, SampledRows
from scheduler.planner import Entry, StepPlanner, is_placeholder
from scheduler.reporting import Reporting
from scheduler.request import Request, Seq, Status
from scheduler.session_pins import SessionPins
from scheduler.speculation import Speculator

logger = logging.getLogger("radixserve.scheduler")


class Scheduler(Forking, Reporting):
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        self.eos_ids = set(info.eos_token_ids)
        self.alloc = PageAllocator(info.num_pages, info.page_size)
        # The prefix cache's host tier: host pages after swap's in the worker's host pool.
        self.host = (HostTier(info.num_host_cache_pages, info.page_size,
                              config.cache_write_policy, first_page=info.num_host_pages,
                              num_sliding_pages=info.num_host_cache_sliding_pages)
                     if info.num_host_cache_pages else None)
        self.tree = RadixTree(self.alloc, POLICIES[config.eviction_policy], host=self.host,
                              sliding=sliding_pages(info))
        # Loads into sequences' own pages (scheduler/loads.py), and the disk tier: the worker
        # opened its store, named its directory and says whether it is set up.
        self.loads = PendingLoads()
        self.disk = (DiskTier(DiskView(config.disk_cache_dir, info.disk_fingerprint),
                              info.disk_block_tokens, info.page_size, self.loads,
                              info.disk_ready, self.tree.sliding)
                     if info.disk_block_tokens else None)
        self.disk_io = BatchResult(batch_id=0)  # the worker's latest disk totals
        speculative = config.speculative()
        self.mem = SeqMemory(self.tree, info.num_host_pages, self.disk, self.loads,
                             host_loads_aside=config.tp_size == 1,
                             saves_at_release=speculative is not None
                             and speculative.model is not None)
        pinnable = config.max_pinned_tokens
        if pinnable is None:
            pinnable = info.num_pages * info.page_size // 2
        self.sessions = SessionPins(self.tree, pinnable)
        self.speculator = (Speculator(speculative, self.tree) if speculative is not None
                           else None)
        self.planner = StepPlanner(config, info, self.mem, self.sessions, self.speculator)
        self.adapters = Adapters(info)
        self.requests: dict[str, Request] = {}
        self.outputs = Outputs(host_tier=self.host is not None, disk_tier=self.disk is not None)
        # Batches sent and not yet answered, oldest first: one, or two while overlapping.
        self.inflight: deque[tuple[int, list[Entry]]] = deque()
        self.batch_id = 0
        self.overlap = (config.overlap_schedule == "on" or config.overlap_schedule == "auto"
                        and info.device.startswith("cuda"))
        self._serial_next = False  # a look-ahead plan went short of pages: wait, then preempt
        self._looked_ahead = False  # a look-ahead plan found nothing; retry after news
        # constrained sequences ended since the last batch: the worker drops their grammars
        self.released_grammars: list[str] = []
        self.constrained_requests = 0
        self.grammar_forced_tokens = 0
        self.grammar_mask_seconds = 0.0
        self.transfer_seconds = 0.0
        self._sent_at = (0, 0.0)  # (batch id, when sent) of the last batch sent with none in flight

    # ------------------------------------------------------------- requests
    @property
    def waiting(self) -> list[Request]:
        return self.planner.waiting

    @property
    def running(self) -> list[Request]:
        return self.planner.running

    @property
    def num_preemptions(self) -> int:
        return self.planner.num_preemptions

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.inflight or self._loads_busy)

    @property
    def _loads_busy(self) -> bool:
        """Loads or disk saves to send, or loads the worker has not reported ended."""
        return self.loads.busy or (self.disk is not None and self.disk.busy)

    def can_schedule(self) -> bool:
        """Whether ``schedule`` may plan now: nothing in flight, or one batch whose outputs the
        next step need not wait for (overlap scheduling, see ``schedule``)."""
        if not (self.waiting or self.running or self._loads_busy):
            return False
        if not self.inflight:
            return True
        if not self.overlap or len(self.inflight) > 1 or self._serial_next or self._looked_ahead:
            return False
        if self.speculator is not None and self.speculator.may_draft(
                sum(len(r.live_seqs()) for r in self.running)):
            return False  # drafts need the settled last token: a look-ahead step has none
        # The batch in flight must decide nothing the next plan depends on: no forks or beam
        # steps (sequences appear or reorder), no penalties (the sampler reads the whole
        # history), no grammar (it may force tokens that the next step must run).
        return all(e.samples <= 1 and not e.seq.req.is_beam and not e.seq.req.has_penalties
                   and e.seq.req.params.structured_outputs is None
                   for e in self.inflight[0][1])

    def add_request(self, msg: TokenizedRequest) -> None:
        prompt = unpack_ids(msg.prompt_ids).copy()
        adapter = self.adapters.served.get(msg.lora_name) if msg.lora_name is not None else None
        req = Request(msg.rid, prompt, msg.params, msg.reply_to,
                      lora_namespace(msg.namespace, adapter), msg.arrival or time.monotonic(),
                      msg.session_id, lora_id=adapter.lora_id if adapter else 0)
        try:
            if msg.lora_name is not None and adapter is None:
                error = 404, f"the LoRA adapter {msg.lora_name!r} does not exist"
            else:
                error = reject_reason(req, self.config, self.info, self.alloc, len(self.waiting))
        except Exception:
            # A request must never take the scheduler (and every other request) down.
            logger.exception("checking request %s failed", req.rid)
            error = 500, "the server failed to admit this request; its log has the details"
        if error is None and req.rid in self.requests:
            error = 400, f"request id {req.rid!r} is already in use"
        if error is not None:
            status, text = error
            self.outputs.emit(req, 0, [], finish_reason="error", error=text, status=status)
            return
        req.seqs.append(Seq(req, 0, prompt.tolist()))
        self.requests[req.rid] = req
        self.constrained_requests += req.params.structured_outputs is not None
        self.waiting.append(req)
        self._looked_ahead = False

    def update_lora(self, msg: LoraUpdate) -> LoraUpdate | LoraUpdated:
        """An adapter load or unload checked (scheduler/adapters.py): the update for the worker,
        or the refusal for the frontend."""
        return self.adapters.check_update(msg, self.requests.values())

    def abort(self, rid: str, reason: str = "abort", index: int = -1) -> None:
        """Release the request's pages now (between steps) and close its outputs; ``index``
        selects one sample (a stop string ends only the sample that produced it)."""
        req = self.requests.get(rid)
        if req is None:
            return
        for seq in req.live_seqs():
            if index >= 0 and seq.index != index:
                continue
            self._end(seq, reason, cache=seq.status is Status.RUNNING, emit=True)
        if not req.live_seqs():
            self._retire(req)

    # ---------------------------------------------------------------- steps
    def schedule(self, admit: bool = True) -> ForwardBatch | None:
        """Plan the next step; None when there is nothing to run now. ``admit``: False plans
        the running requests only (scheduler/refill.py).

        Overlap: while the worker runs batch k, the next step is planned and sent, so the worker
        starts it the moment k ends while k's outputs are handled here. Each sequence is advanced
        as its batch is sent (``computed``, and a placeholder ``-1 - row`` for the token it will
        sample, which the worker resolves from its previous batch's samples). Pages freed while
        a batch is in flight are only reused by later batches, which the worker runs after it.
        A look-ahead plan preempts nothing: short of pages, it skips, and the step after waits
        for the pipeline to drain and preempts as usual."""
        if not self.can_schedule():
            return None
        lookahead = bool(self.inflight)
        plan = self.planner.plan(lookahead=lookahead, admit=admit)
        self._serial_next = plan.starved
        if plan.unschedulable is not None:
            self._fail(plan.unschedulable, 503,
                       "the request cannot be scheduled: the KV pool is too small for it")
        if not plan.entries:
            if lookahead or not self._loads_busy:
                self._looked_ahead = lookahead
                return None
            # Nothing to compute, but loads or saves to send or loads to hear of: a step of
            # page moves only (the work planned so far goes with it, so no load overtakes a
            # move planned before it).
            plan.work, self.planner.carry = self.planner.carry, plan.work
        self.batch_id += 1
        if self.host is not None:
            # The host tier's write-downs and loads planned since the last batch run first in
            # this one (with the swaps: every copy down, then every copy up).
            write_downs, loads = self.host.take_moves()
            plan.work.swap_out += write_downs
            plan.work.swap_in += loads
            write_downs, loads = self.host.take_window_moves()
            plan.work.swa_swap_out += write_downs
            plan.work.swa_swap_in += loads
        batch = build_batch(self.batch_id, plan.entries, plan.work, self.info.page_size,
                            self.released_grammars, self.tree.sliding)
        self.released_grammars = []
        batch.host_loads = self.loads.take_host()
        if self.disk is not None:
            batch.disk_saves, batch.disk_loads = self.disk.take()
        row = 0
        for entry in plan.entries:
            seq = entry.seq
            seq.computed = entry.end = seq.computed + entry.extend - len(entry.drafts)
            seq.prefills_in_flight += entry.extend > 1 and not entry.drafts
            if entry.samples == 1 and not seq.req.is_beam:
                entry.token_index = len(seq.tokens)
                seq.tokens.append(-1 - row)
            row += entry.samples
        self.inflight.append((self.batch_id, plan.entries))
        if self.speculator is not None and not lookahead:
            self._sent_at = (self.batch_id, time.perf_counter())  # what drafts cost: its time
        return batch

    def process_result(self, result: BatchResult) -> None:
        batch_id, entries = self.inflight.popleft()
        assert result.batch_id == batch_id, f"result of batch {result.batch_id}, expected {batch_id}"
        if self._sent_at[0] == batch_id and result.error is None:
            self.speculator.step_took(entries, time.perf_counter() - self._sent_at[1])
        self._looked_ahead = False
        self._loads_ended(result)
        if result.error is not None:
            for req in {id(e.seq.req): e.seq.req for e in entries}.values():
                self._fail(req, 500, f"the model runner failed on this request's batch "
                           f"({result.error}); the server log has the details")
            return
        rows = SampledRows(result)
        self.outputs.prompt_logprobs(entries, result)
        self.grammar_forced_tokens += sum(map(len, rows.forced.values()))
        self.grammar_mask_seconds += result.mask_seconds
        self.transfer_seconds += result.transfer_seconds
        refused = dict(result.grammar_failures)  # row: why its grammar did not compile
        next_row = 0  # an entry's logits rows follow the previous entry's
        beam_rows: dict[int, list[tuple[Seq, int]]] = {}
        # each verification's drafts and those accepted (scheduler/speculation.py)
        verified = self.speculator.verified(entries, rows) if self.speculator else {}
        for entry in entries:
            seq, row = entry.seq, next_row
            next_row += entry.samples
            self.mem.copies_done(seq)
            seq.prefills_in_flight -= entry.extend > 1 and not entry.drafts
            if seq.status is not Status.RUNNING:
                continue
            why = next((refused[r] for r in range(row, next_row) if r in refused), None)
            if why is not None:
                self._fail(seq.req, 400, why)  # this request alone: its rows' samples dropped
                continue
            seq.settled = entry.end
            if seq.closing and entry.samples:
                # A session turn that ended in the step before this one: this step computed its
                # last token's KV (its sample is dropped), so the turn is cached to its end.
                self._finish(seq, seq.finish_reason)
                continue
            if row in verified:
                # Verification: the accepted drafts' KV is kept, the rest rolls back.
                kept = self.speculator.accept(seq, *verified[row], entry.model_drafts)
                seq.computed = seq.settled = entry.end + kept - 1
                self.mem.trim(seq, seq.computed + 1)
                last = row + kept - 1  # the tokens a grammar forced follow the last
                self._append(seq, [*rows.tokens[row:last].tolist(), *rows.after(last)], rows, row)
                if seq.status is Status.RUNNING:  # a stop inside the drafts ends the tokens
                    seq.computed = seq.settled = min(seq.computed, len(seq.tokens) - 1)
                self._grammar_ended(seq, last in rows.grammar_ended)
                continue
            if entry.extend > 1:
                self.mem.commit(seq, entry.end)
            if entry.samples == 0:
                if seq.closing:
                    self._finish(seq, seq.finish_reason)
                continue
            if seq.req.is_beam:
                beam_rows.setdefault(id(seq.req), []).append((seq, row))
            elif entry.samples > 1:
                self._fork_samples(seq, entry.samples, rows, row)
            else:
                self._append(seq, rows.after(row), rows, row, entry.token_index)
                self._grammar_ended(seq, row in rows.grammar_ended)
        for beams in beam_rows.values():
            try:
                self._beam_step(beams, rows)
            except Exception:
                # One request's beams failing ends that request alone.
                req = beams[0][0].req
                logger.exception("beam step of request %s failed", req.rid)
                self._fail(req, 500, "the server failed on this request's beam search; its "
                           "log has the details")
        for req in [r for r in self.running if not r.live_seqs()]:
            self._retire(req)

    def _loads_ended(self, result: BatchResult) -> None:
        """Sequences whose loads ended run from the tokens that arrived."""
        if self.disk is not None:
            self.disk_io = result
            if result.disk_off:  # the worker found the directory gone: no more lookups
                self.disk.store.turn_off("the model worker found its directory gone")
            self.disk.ready = result.disk_ready
        for load_id, arrived in result.loads_ended:
            pending = self.mem.load_ended(load_id, arrived)
            if pending is None:
                continue
            seq, req = pending.seq, pending.seq.req
            if self.mem.loads_again(pending, arrived):
                self.planner.admit_again(req)  # it looks the disk up again, or computes
                continue
            if pending.kind == "disk":
                self.disk.loaded(arrived, pending.asked)
                # admitted again after a preemption: the first load's counts hold
                req.cached_tokens_disk = max(req.cached_tokens_disk, arrived * self.disk.block)
                req.cached_tokens = max(req.cached_tokens, seq.computed)
            elif not arrived:  # a host load that failed: those tokens are computed after all
                req.cached_tokens = min(req.cached_tokens, seq.computed)
                req.cached_tokens_host = 0
            seq.status = Status.RUNNING

    def _append(self, seq: Seq, new: list[int], rows: SampledRows, row: int,
                index: int = -1) -> None:
        """``new`` are ``seq``'s next outputs, sampled at rows ``row``, ``row + 1``, ...: the
        first at ``tokens[index]`` (its placeholder), or all appended; it ends at the first one
        that finishes it (a verification's accepted drafts can hold a stop token)."""
        if index < 0:
            index = len(seq.tokens)
            seq.tokens.append(new[0])
        else:
            seq.tokens[index] = new[0]
        if len(new) == 1:
            reason = seq.ending(new[0], index + 1, self.eos_ids, self.info.context_len)
        else:  # a verification's tokens: where the first that ends it is, in one pass
            end, reason = seq.first_ending(new, index + 1, self.eos_ids,
                                           self.info.context_len)
            new = new[: end + 1]
            seq.tokens.extend(new[1:])
        lp, tid, tlp = rows.logprob_bytes(row, row + len(new), seq.req.params.logprobs)
        self.outputs.emit(seq.req, seq.index, new, finish_reason=reason, logprobs=lp,
                          top_ids=tid, top_logprobs=tlp)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: str) -> None:
        req = seq.req
        if (req.session_id is not None and not seq.closing and not req.is_beam
                and seq.index == 0 and self.sessions.is_open(req.session_id)):
            # The next turn's prompt starts with this whole sequence: run its last sampled token
            # through the model (one step, no sample; or the step in flight already does) so
            # the history is cached to its end.
            seq.closing, seq.finish_reason = True, reason
            return
        self._end(seq, reason, cache=True)

    def _end(self, seq: Seq, reason: str, *, cache: bool, emit: bool = False,
             error: str | None = None, status: int = 200) -> None:
        """The one way a sequence ends: its pages released (with ``cache``, its KV into the
        tree first), its status finished, and with ``emit`` its closing output sent (a sampled
        token's output closes it already)."""
        self._release(seq, cache=cache)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq.req.params.structured_outputs is not None:
            self.released_grammars.append(f"{seq.req.rid}#{seq.index}")
        if emit:
            self.outputs.emit(seq.req, seq.index, [], finish_reason=reason, error=error,
                              status=status)

    def _release(self, seq: Seq, *, cache: bool) -> None:
        """Release ``seq``'s pages; a session's cached turn becomes the session's pinned history.
        A token the batch in flight samples for it is dropped; pages that batch still writes
        can only go to batches sent after it, which the worker runs later."""
        while seq.tokens and is_placeholder(seq.tokens[-1]):
            seq.tokens.pop()
        history = seq.tokens[: seq.settled]
        self.mem.release(seq, cache=cache)
        req = seq.req
        if cache and req.session_id is not None and seq.index == 0 and not req.is_beam:
            self.sessions.pin(req.session_id, history, req.namespace, time.monotonic())

    def _grammar_ended(self, seq: Seq, ended: bool) -> None:
        """A constrained sequence whose grammar can take nothing more ends with "stop" (unless
        its last token ended it already)."""
        if ended and seq.status is Status.RUNNING and not seq.closing:
            self.outputs.emit(seq.req, seq.index, [], finish_reason="stop")
            self._finish(seq, "stop")

    # ------------------------------------------------------------- outputs
    def take_outputs(self) -> dict[int, list[SeqOutput]]:
        return self.outputs.take()

    def _fail(self, req: Request, status: int, message: str) -> None:
        logger.warning("request %s failed: %s", req.rid, message)
        for seq in req.live_seqs():
            self._end(seq, "error", cache=False, emit=True, error=message, status=status)
        if not req.seqs:
            self.outputs.emit(req, 0, [], finish_reason="error", error=message, status=status)
        self._retire(req)

    def _retire(self, req: Request) -> None:
        self.requests.pop(req.rid, None)
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)

    # ------------------------------------------------------------ checking
    def check(self) -> None:
        """The accounting invariant over the tree and every live sequence, and the suffix
        index's bookkeeping (run on idle)."""
        seqs = [s for r in self.requests.values() for s in r.live_seqs()]
        self.mem.check(seqs)
        if self.speculator is not None:
            self.speculator.check()
