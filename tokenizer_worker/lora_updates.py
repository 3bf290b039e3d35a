"""Runtime LoRA loads and unloads across data-parallel replicas: each update goes to every live
replica and the frontend gets one answer once all of them have answered (or stopped).

Every replica serves every adapter (the dispatcher routes an adapter's requests by load alone),
so a load counts only where every replica took it: a load some replicas refused is unloaded
again from those that took it, and the frontend gets the refusal. A replica that stops before
it answers is no longer waited for. A single engine is the case of one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.contracts.protocol import LoraUpdate, LoraUpdated

UNDO = "-undo"  # suffix of the rid of a load's rollback, whose answers nobody waits for


@dataclass
class _Pending:
    update: LoraUpdate
    waiting: set[int]
    answers: dict[int, LoraUpdated] = field(default_factory=dict)


class LoraFanOut:
    def __init__(self) -> None:
        self.pending: dict[str, _Pending] = {}

    def start(self, update: LoraUpdate, replicas: list[int]) -> LoraUpdated | None:
        """Note ``update`` as sent to ``replicas``; the answer at once if there is none."""
        if not replicas:
            return LoraUpdated(rid=update.rid, reply_to=update.reply_to, status=503,
                               error="no data-parallel replica is serving; retry later")
        self.pending[update.rid] = _Pending(update, set(replicas))
        return None

    def answer(self, replica: int, msg: LoraUpdated
               ) -> tuple[LoraUpdated | None, list[tuple[int, LoraUpdate]]]:
        """``replica``'s answer: the frontend's answer once every replica has given one (else
        None), and the unloads that roll back a load some replicas refused."""
        pending = self.pending.get(msg.rid)
        if pending is None or replica not in pending.waiting:
            return None, []  # a rollback's answer, or from a replica no longer waited for
        pending.waiting.discard(replica)
        pending.answers[replica] = msg
        return self._settle(msg.rid)

    def replica_down(self, replica: int
                     ) -> list[tuple[LoraUpdated | None, list[tuple[int, LoraUpdate]]]]:
        """Stop waiting for ``replica``: the updates that thereby have every answer."""
        settled = []
        for rid in [rid for rid, p in self.pending.items() if replica in p.waiting]:
            self.pending[rid].waiting.discard(replica)
            settled.append(self._settle(rid))
        return settled

    def _settle(self, rid: str) -> tuple[LoraUpdated | None, list[tuple[int, LoraUpdate]]]:
        pending = self.pending[rid]
        if pending.waiting:
            return None, []
        del self.pending[rid]
        update, answers = pending.update, pending.answers
        if not answers:
            return LoraUpdated(rid=rid, reply_to=update.reply_to, status=503,
                               error="every data-parallel replica stopped before it answered; "
                                     "retry later"), []
        refused = [a for a in answers.values() if a.error is not None]
        if not refused:
            return next(iter(answers.values())), []
        undo = []
        if update.path is not None:  # a load: take it back where it was taken
            undo = [(r, LoraUpdate(rid=rid + UNDO, name=update.name, reply_to=update.reply_to))
                    for r, a in answers.items() if a.error is None]
        return refused[0], undo
