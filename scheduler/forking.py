"""Sequences that split, as the scheduler's steps sample them: ``n > 1`` samples forked from
one prefill, and beam search (``scheduler/beam.py`` keeps its bookkeeping), whose beams fork
where a parent has several chosen continuations and finish where it has none. Every fork
shares its parent's pages (``SeqMemory.fork``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scheduler import beam
from scheduler.outputs import SampledRows
from scheduler.request import Seq, Status

if TYPE_CHECKING:
    from engine.contracts.worker_messages import ModelInfo
    from scheduler.kv import SeqMemory
    from scheduler.outputs import Outputs


class Forking:
    """Mixed into ``Scheduler``: these use its state below and its ``_append``,
    ``_grammar_ended`` and ``_finish``."""

    mem: SeqMemory
    outputs: Outputs
    info: ModelInfo
    eos_ids: set[int]

    def _fork(self, parent: Seq) -> Seq:
        """A new running sequence of ``parent``'s request, sharing its tokens and KV."""
        child = Seq(parent.req, len(parent.req.seqs), parent.tokens.copy(), status=Status.RUNNING)
        self.mem.fork(parent, child)
        parent.req.seqs.append(child)
        return child

    def _fork_samples(self, parent: Seq, samples: int, rows: SampledRows, row: int) -> None:
        parent.req.forked = True  # it has one sequence so far: the samples are numbered 1, 2, ...
        children = [parent] + [self._fork(parent) for _ in range(1, samples)]
        for i, child in enumerate(children):
            self._append(child, rows.after(row + i), rows, row + i)
            self._grammar_ended(child, row + i in rows.grammar_ended)

    def _beam_step(self, beam_rows: list[tuple[Seq, int]], rows: SampledRows) -> None:
        beams = [seq for seq, _ in beam_rows]
        req = beams[0].req
        p = req.params
        width = p.beam_width
        idx = [r for _, r in beam_rows]
        eos = set() if p.ignore_eos else self.eos_ids | set(p.stop_token_ids)
        chosen, ended = beam.select([s.cum_logprob for s in beams], rows.top_ids[idx],
                                    rows.top_lps[idx].astype(np.float64), width, eos)
        generated = beams[0].num_outputs + 1
        for cand in ended:
            req.finished_beams.append((
                beam.score(cand.cum_logprob, generated, p.length_penalty),
                beams[cand.parent].tokens[req.prompt_len :],
            ))
        req.forked = True
        next_beams: list[Seq] = []
        used: set[int] = set()
        for cand in chosen:
            parent = beams[cand.parent]
            if cand.parent in used:
                seq = self._fork(parent)
            else:
                seq = parent
                used.add(cand.parent)
            next_beams.append(seq)
        for i, cand in enumerate(chosen):
            next_beams[i].tokens.append(cand.token)
            next_beams[i].cum_logprob = cand.cum_logprob
        for i, parent in enumerate(beams):
            if i not in used:
                self._finish(parent, "stop")
        best_running = max(s.cum_logprob for s in next_beams)
        done = beam.is_done([s for s, _ in req.finished_beams], best_running, generated, width,
                            p.length_penalty)
        at_limit = len(next_beams[0].tokens) >= req.max_len(self.info.context_len)
        if not (done or at_limit):
            return
        hyps = list(req.finished_beams)
        if not done:
            hyps += [(beam.score(s.cum_logprob, generated, p.length_penalty),
                      s.tokens[req.prompt_len :]) for s in next_beams]
        hyps.sort(key=lambda h: -h[0])
        for seq in next_beams:
            self._finish(seq, "length")
        for i, (_, out) in enumerate(hyps[: p.n]):
            reason = "stop" if out is not None and len(out) < p.max_tokens else "length"
            self.outputs.emit(req, i, out, finish_reason=reason, replace=True)
