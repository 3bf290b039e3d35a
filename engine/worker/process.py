"""The GPU worker process: receives a ForwardBatch, runs its step (copies/swaps, the forward)
and the sampler (constrained rows through their grammars: engine/worker/grammar.py), and
replies with one token per sampling row. It decides nothing about memory.

With ``--tp-size`` > 1 it is rank 0 of the tensor-parallel group (engine/worker/distributed.py): it
hands every step, its input ids resolved, to the other ranks (engine/worker/tp_rank.py) before
running its own share of the forward, and every LoRA load (once its own succeeded) or unload."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import numpy as np
import zmq

from engine.contracts.engine_config import EngineConfig, LaunchSpec
from engine.contracts.protocol import (
    LoraUpdate,
    LoraUpdated,
    Shutdown,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from engine.contracts.worker_messages import BatchResult, ForwardBatch, ModelInfo, WorkerReady
from engine.worker.distributed import GroupBroken, TensorParallel, start_tensor_parallel

if TYPE_CHECKING:
    from engine.worker.runner import ModelRunner

logger = logging.getLogger("radixserve.worker")

LOAD_POLL_SECONDS = 0.01  # a step of page moves only waits this long for a load to end
FLUSH_ON_EXIT_SECONDS = 4.0  # within the launcher's grace of 5 s
PREFAULT_ENV = "RADIXSERVE_KV_PREFAULT"  # "0": the CPU KV pool's memory is left to first writes


def make_runner(c: EngineConfig, tp: TensorParallel | None = None, draft_page_bytes: int = 0):
    """The model runner ``c`` describes (``tp``: this rank's share of it; ``draft_page_bytes``:
    a draft model's KV per page, counted in the pool's budget); torch is imported here, not
    when the process starts."""
    from engine.worker.runner import ModelRunner

    return ModelRunner(c, tp, draft_page_bytes=draft_page_bytes)


class Worker:
    def __init__(self, c: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.tp = tp
        from engine.worker.draft import DraftModel, draft_checkpoint, draft_page_bytes

        draft_dir = draft_checkpoint(c)  # --speculative-config's draft model, if any
        self.runner = make_runner(c, tp, draft_page_bytes(c, draft_dir))
        self.draft = (DraftModel(c, draft_dir, self.runner.num_pages,
                                 self.runner.num_host_pages + self.runner.num_host_cache_pages)
                      if draft_dir is not None else None)
        mc = self.runner.config
        self.info = ModelInfo(
            model=c.served_model_name or c.model, architecture=mc.architecture,
            vocab_size=mc.vocab_size, context_len=c.serving_context_len(mc.max_context_len),
            eos_token_ids=list(mc.eos_token_ids), page_size=self.runner.page_size,
            num_pages=self.runner.num_pages, num_host_pages=self.runner.num_host_pages,
            device=str(self.runner.device), dtype=str(self.runner.dtype).removeprefix("torch."),
            attention_backend=self.runner.attention_backend,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            kv_cache_bytes=self.runner.kv_cache_bytes, weight_bytes=self.runner.weight_formats,
            linear_forms=self.runner.model.linear_forms,
            num_host_cache_pages=self.runner.num_host_cache_pages,
            num_sliding_pages=self.runner.num_sliding_pages,
            num_host_cache_sliding_pages=self.runner.num_host_cache_sliding_pages,
            sliding_window=self.runner.sliding_window,
        )
        if self.runner.lora is not None:
            self.info.lora_adapters = list(self.runner.lora.infos.values())
            self.info.max_loras = self.runner.lora.max_loras
        from engine.worker.tier_io import open_tier_io

        # the tiers' I/O thread, if there are tiers (a draft's KV travels with the model's)
        self.io = open_tier_io(c, self.runner, self.draft)
        if self.io is not None and self.io.store is not None:
            self.info.disk_fingerprint = self.io.store.fingerprint
            self.info.disk_block_tokens = self.io.block_tokens
            self.info.disk_ready = self.io.store.ready
        from engine.worker.grammar import Grammars

        self.grammars = Grammars(c.model, mc.vocab_size, list(mc.eos_token_ids))
        # The previous batch's sampled tokens: a step planned while that batch ran (overlap
        # scheduling) names them as input ids ``-1 - row``.
        self.last_tokens = np.zeros(0, dtype=np.int32)
        self._loads_started = False  # the batch being handled started its loads

    def update_lora(self, msg: LoraUpdate) -> LoraUpdated:
        """Load or unload an adapter between steps (the scheduler checked the names); a load
        whose files do not fit the model fails with a sentence. Under tensor parallel every
        rank loads its share after this one, behind the steps already sent, and the load
        counts only if all of them read the same files (else every rank drops it)."""
        reply = LoraUpdated(rid=msg.rid, reply_to=msg.reply_to)
        if msg.path is None:
            self.runner.lora.remove(msg.lora_id)
            if self.tp is not None:
                self.tp.send_step(encode(msg))
            return reply
        try:
            reply.adapter = self.runner.load_lora(msg.lora_id, msg.name, msg.path)
        except Exception as exc:  # a bad adapter fails its load, never the worker
            logger.warning("loading LoRA adapter %r from %s failed: %s", msg.name, msg.path, exc)
            reply.error, reply.status = (str(exc) if isinstance(exc, ValueError) else
                                         f"the LoRA adapter at {msg.path} could not be read "
                                         f"({type(exc).__name__}: {exc})"), 400
            return reply
        if self.tp is not None:
            msg.content_hash = reply.adapter.content_hash
            self.tp.send_step(encode(msg))
            if not self.tp.agree_min(1):
                self.runner.lora.remove(msg.lora_id)
                reply.adapter, reply.status = None, 400
                reply.error = (f"the LoRA adapter at {msg.path} could not be loaded on every "
                               "tensor-parallel rank (the ranks' logs say why)")
        return reply

    def step(self, msg: ForwardBatch) -> BatchResult:
        from engine.worker.sampler import sample
        from engine.worker.verify_rows import kept_rows, widened, without_drafts

        # Until this batch samples, a failure leaves placeholder rows for the next batch to read
        # (their sequences fail with this batch; the scheduler drops what the next one computes
        # for them).
        step = msg.step
        if self.io is not None:
            # the disk saves' pages are read before anything writes them (the draft's too)
            self.io.save(msg.disk_saves)
        if not step.num_seqs:
            return self._move_pages(msg)
        sampled, self.last_tokens = self.last_tokens, np.zeros(len(msg.sampling), dtype=np.int32)
        _resolve_placeholders(step, sampled)
        self.grammars.release(msg.released_grammars)
        masks, grammar_failure = None, None
        try:
            masks = self.grammars.start_masks(msg.sampling, step)  # filled during the forward
        except Exception as exc:
            # Raised after the forward: the batch's page moves (copies down to the host tier,
            # loads, copy-on-write) must run, since the scheduler's tree already counts on them.
            grammar_failure = exc
        prompt_rows = unpack_ids(msg.prompt_rows)
        sampling, keep = msg.sampling, None
        unused = np.zeros(step.num_seqs, np.int64)  # verify rows of drafts not made or cut
        if self.draft is not None:
            # its page moves and forwards; the drafts into the step
            self.draft.propose(step, self.grammars.guide(masks))
            unused += self.draft.unused(step)
        if masks is not None and masks.verifies:
            unused += self.grammars.cut_drafts(masks, step, unused)
        if unused.any() and not len(prompt_rows):  # prompt rows are the full step's
            step, keep = without_drafts(step, unused, self.runner.page_size)
            sampling = [msg.sampling[r] for r in keep.tolist()]
        if len(prompt_rows):
            # Prompt logprobs: the logits of those rows too, after the sampled rows'.
            step.logits_rows = np.concatenate([step.resolved_logits_rows(), prompt_rows])
        logits = self._forward(msg, step)
        rows = [_row_state(row) for row in sampling]
        if grammar_failure is not None:
            raise grammar_failure
        prompt_logits = None
        if len(prompt_rows):
            logits, prompt_logits = logits[: len(msg.sampling)], logits[len(msg.sampling):]
        allowed = None
        if masks is not None and masks.rows:
            allowed = kept_rows(masks.rows, self.grammars.allowed(
                masks, logits.device, logits.shape[-1]), keep, len(msg.sampling))
        out = widened(sample(logits, rows, allowed), keep, len(msg.sampling))
        self.last_tokens = out.token_ids.astype(np.int32, copy=False)
        result = BatchResult(
            batch_id=msg.batch_id,
            token_ids=self.last_tokens.tobytes(),
            logprobs=out.logprobs.astype(np.float32, copy=False).tobytes(),
        )
        result.transfer_seconds = self.runner.transfer_seconds
        if self.draft is not None:
            self.draft.settle(step, out.token_ids, result)
        if masks is not None:
            self._grammar_outputs(result, msg, masks, out.token_ids)
        if prompt_logits is not None:
            _prompt_logprobs(result, prompt_logits, unpack_ids(msg.prompt_targets),
                             msg.prompt_top_n)
        if out.top_ids is not None:
            result.top_n = out.top_ids.shape[1]
            result.top_ids = out.top_ids.astype(np.int32).tobytes()
            result.top_logprobs = out.top_logprobs.astype(np.float32).tobytes()
        return self.report_loads(result)

    def _grammar_outputs(self, result: BatchResult, msg: ForwardBatch, masks,
                         token_ids: np.ndarray) -> None:
        """The grammars take the sampled tokens: what each forced after its sample, and which
        can take nothing more, go into ``result``; so do the drafts each constrained
        verification's grammar kept."""
        advanced = self.grammars.advance(msg.sampling, masks, token_ids)
        if masks.verifies:
            kept = np.full(msg.step.num_seqs, -1, np.int32)
            kept[[v.seq for v in masks.verifies]] = [v.kept for v in masks.verifies]
            result.grammar_drafts = kept.tobytes()
        if advanced.forced:
            counts = np.zeros(len(msg.sampling), dtype=np.int32)
            counts[list(advanced.forced)] = [len(ids) for ids in advanced.forced.values()]
            result.forced_counts = counts.tobytes()
            result.forced_ids = pack_ids([t for row in sorted(advanced.forced)
                                          for t in advanced.forced[row]])
        result.grammar_ended = pack_ids(advanced.ended)
        result.grammar_failures = list(masks.failed.items())
        result.mask_seconds = masks.seconds

    def handle(self, msg: ForwardBatch) -> BatchResult:
        """``step``, a failure answered: the scheduler fails this batch's requests (logging
        their ids) and keeps serving. The traceback stays in this log: the error reaches
        clients, so it names only the kind of failure. Disk loads the batch carried that never
        started are reported as ended with nothing (their requests compute instead)."""
        self._loads_started = False
        try:
            return self.step(msg)
        except GroupBroken:
            raise  # the ranks may be out of step: the group ends (engine/runtime/child.py says)
        except Exception as exc:
            logger.exception("batch %d failed", msg.batch_id)
            if self.io is not None and not self._loads_started:
                self.io.never_started([*msg.host_loads, *msg.disk_loads])
            return self.report_loads(BatchResult(batch_id=msg.batch_id, error=type(exc).__name__))

    def _forward(self, msg: ForwardBatch, step):
        """The step's page moves and forward, after the disk tier's saves (``step`` copied their
        pages out before anything writes) and with its loads running beside it: they start once
        the step's write-downs have read the pages they may reuse, and write only pages that no
        batch reads until the load is reported (neither runs under tensor parallel, whose
        ranks would each need their share)."""
        if self.io is not None:
            if msg.disk_loads or msg.host_loads:
                self.runner.write_down(step)
                self.io.load([*msg.host_loads, *msg.disk_loads])
                self._loads_started = True
        if self.tp is None:
            return self.runner.forward(step)
        return self._forward_all_ranks(msg.batch_id, step)

    def _move_pages(self, msg: ForwardBatch) -> BatchResult:
        """A step of no sequences: its page moves and the tiers' work, then (when loads
        are running) a short wait for one to end, so a scheduler with nothing else to run does
        not spin. The previous batch's samples stay what the next batch's placeholders read."""
        self.grammars.release(msg.released_grammars)
        if self.draft is not None:
            self.draft.propose(msg.step)  # the same page moves in the draft's pool
        self._forward(msg, msg.step)
        if self.io is not None:
            self.io.wait(LOAD_POLL_SECONDS)
        return self.report_loads(BatchResult(batch_id=msg.batch_id))

    def report_loads(self, result: BatchResult) -> BatchResult:
        """The tiers' news on ``result``: loads that ended, and the disk tier's totals."""
        io = self.io
        if io is not None:
            result.loads_ended = io.finished()
            if io.store is not None:
                store = io.store
                result.disk_bytes_read, result.disk_bytes_written = (store.bytes_read,
                                                                     store.bytes_written)
                result.disk_load_seconds, result.disk_rejected = io.load_seconds, store.rejected
                result.disk_off, result.disk_ready = not store.enabled, store.ready
        return result

    def _forward_all_ranks(self, batch_id: int, step):
        """Tensor parallel: the step (input ids resolved) to every rank, then this rank's
        forward. A batch the runner refuses fails alone, before any other rank sees it."""
        self.runner.check(step)
        self.tp.send_step(encode(ForwardBatch(batch_id=batch_id, step=step, sampling=[])))
        try:
            return self.runner.forward(step, checked=True)
        except Exception as exc:
            raise GroupBroken(f"batch {batch_id} failed inside the tensor-parallel forward "
                              f"({type(exc).__name__}: {exc})") from exc


def _resolve_placeholders(step, sampled: np.ndarray) -> None:
    """Input id ``-1 - row`` stands for the token the previous batch sampled at ``row``
    (overlap scheduling sends a batch before its inputs are known)."""
    placeholders = step.input_ids < 0
    if not placeholders.any():
        return
    rows = -1 - step.input_ids[placeholders]
    if rows.max() >= len(sampled):
        raise ValueError(f"input ids name row {rows.max()} of the previous batch, which "
                         f"sampled {len(sampled)}")
    step.input_ids = step.input_ids.copy()
    step.input_ids[placeholders] = sampled[rows]


def _row_state(row):
    """The sampler's view of one row: its params and, for penalties, its token history."""
    from engine.worker.sampler import RowState

    history = unpack_ids(row.history)
    if len(history):
        return RowState(row.params, history[: row.prompt_len], history[row.prompt_len :])
    # No penalties: the sampler needs only the step index, len(output_ids).
    return RowState(row.params, history, np.zeros(row.output_len, dtype=np.int32))


def _prompt_logprobs(result: BatchResult, logits, targets: np.ndarray, top_n: int) -> None:
    """Each prompt row's logprob at its target (the next prompt token) and its top ``top_n``,
    from the raw logits as the sampler reports generated tokens'."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.from_numpy(targets.astype(np.int64)).to(logprobs.device)
    result.prompt_logprobs = logprobs.gather(1, index[:, None]).squeeze(1).cpu().numpy().tobytes()
    if top_n:
        values, ids = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
        result.prompt_top_ids = ids.to(torch.int32).cpu().numpy().tobytes()
        result.prompt_top_logprobs = values.cpu().numpy().tobytes()


def prefault_pool(*runners: ModelRunner) -> int:
    """Write the runners' CPU KV pools' pages once, before serving (every tensor-parallel
    rank its own: rank 0 waits for the others at each step): their memory is calloc'd (resident
    only once written, engine/worker/kv_pool.py), so a server's steps would otherwise fault it in
    as their tokens reach pages never written, 2 MiB at a time, 0.3-5 ms each in a VM whose
    host backs the memory only then (a wave step of 8 x 32 tokens: two such faults, 102-112
    ms against 87-95 ms prefaulted; docs/benchmarks.md). The bytes written (0 with
    RADIXSERVE_KV_PREFAULT=0, or on an accelerator)."""
    if os.environ.get(PREFAULT_ENV, "1") == "0":
        return 0
    pools = [tensor for runner in runners for tensor in (runner.pool.kv, runner.pool.swa)
             if tensor.device.type == "cpu" and tensor.numel()]
    size = sum(pool.numel() * pool.element_size() for pool in pools)
    available = available_memory()
    if available is not None and size > available:
        raise ValueError(
            f"the CPU KV pool takes {size / 2**30:.2f} GiB but {available / 2**30:.2f} GiB of "
            "memory is available: give a smaller --kv-cache-gb (or --num-pages), or "
            f"{PREFAULT_ENV}=0 to leave its pages to be written as they fill")
    for pool in pools:
        pool.zero_()  # nothing is cached before serving: zeros, as calloc gave them
    return size


def available_memory() -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, bounded by the cgroup's
    (v2) memory.max less its memory.current where one is set; None where neither is readable."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, \
                open("/sys/fs/cgroup/memory.current") as current:
            text = limit.read().strip()
            if text != "max":
                found.append(max(int(text) - int(current.read()), 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    pull = ctx.socket(zmq.PULL)
    pull.bind(spec.endpoints.worker_in)
    push = ctx.socket(zmq.PUSH)
    push.connect(spec.endpoints.worker_out)
    tp = start_tensor_parallel(spec.config, rank=0) if spec.config.tp_size > 1 else None
    worker = Worker(spec.config, tp)
    began = time.perf_counter()
    if written := prefault_pool(worker.runner, *([worker.draft.runner] if worker.draft else [])):
        logger.info("KV pool: %.2f GiB written before serving in %.2f s", written / (1 << 30),
                    time.perf_counter() - began)
    push.send(encode(WorkerReady(worker.info)))
    worker.grammars.prepare()  # in the background, while the first requests come in
    if worker.io is None or worker.io.store is None:
        _serve(worker, pull, push, tp)
        return
    # The launcher stops children with SIGUSR1: the disk tier first writes what is queued.
    signal.signal(signal.SIGUSR1, _exit)
    try:
        _serve(worker, pull, push, tp)
    finally:
        worker.io.close(FLUSH_ON_EXIT_SECONDS)


def _exit(signum, frame) -> None:
    raise SystemExit(0)


def _serve(worker: Worker, pull: zmq.Socket, push: zmq.Socket, tp: TensorParallel | None) -> None:
    while True:
        msg = decode(pull.recv())
        if isinstance(msg, Shutdown):
            if tp is not None:
                tp.send_step(encode(msg))
            return
        if isinstance(msg, LoraUpdate):
            push.send(encode(worker.update_lora(msg)))
            continue
        push.send(encode(worker.handle(msg)))
