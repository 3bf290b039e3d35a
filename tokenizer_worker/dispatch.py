"""Data-parallel dispatch (``--dp-size`` > 1): which replica (a scheduler and its worker, with
its own KV pool and radix tree) gets each tokenized request. Pure state, no sockets: the
tokenizer process (``tokenizer_worker/process.py``) feeds it events and outputs.

Policy ``cache_aware`` (SGLang's router's rule, over token ids)::

    loads imbalanced?  max - min > balance_abs  and  max > min * balance_rel
        yes ─▶ least loaded
        no  ─▶ longest cached match (ReplicaCache.match, ties: less loaded)
               match < cache_threshold * prompt ─▶ least loaded

Least loaded breaks ties by the smaller cache, then the lower index. ``round_robin`` cycles.
Either way a session (``session_id``) stays on the replica it was opened on; if that replica
dies, its next turn opens the session again where the policy sends it (the history lives in
this tokenizer worker, so only the cache is lost).

Load is the number of requests this dispatcher sent to a replica that have not finished. With
several tokenizer workers each dispatcher counts its own share (their sum is the replica's
load); with the default single one the count is exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.contracts.kv_events import chain_hashes
from engine.contracts.protocol import (
    DispatchStats,
    ReplicaLoad,
    SchedulerStats,
    SeqOutput,
    TokenizedRequest,
    unpack_ids,
)
from tokenizer_worker.replica_cache import ReplicaCache

POLICIES = ("cache_aware", "round_robin")


class NoReplica(RuntimeError):
    """Every replica is down."""


@dataclass
class Replica:
    cache: ReplicaCache
    alive: bool = True
    in_flight: int = 0
    routed: int = 0
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    stats: SchedulerStats | None = None

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.alive, self.in_flight, self.routed, self.predicted_cached_tokens,
                           self.actual_cached_tokens, self.cache.num_blocks, self.cache.resets,
                           self.stats)


@dataclass
class Routed:
    """A request in flight on ``replica``."""

    replica: int
    hashes: list[int]  # its prompt's block hashes, coming on that replica until it finishes
    windows: list[int]  # of those, the window it will keep (sliding-window layers)
    predicted: int  # cached tokens the dispatcher expected
    actual: int = -1  # cached tokens the replica reported (-1: not admitted yet)
    # Until its first output: the request, to send elsewhere if its replica dies meanwhile
    # (nothing of it has reached the client yet, so it can start over).
    request: TokenizedRequest | None = None


@dataclass
class Session:
    replica: int
    ttl: float


def choose(matches: list[int], loads: list[int], cached: list[int], alive: list[bool],
           block_size: int, prompt_len: int, *, threshold: float,
           balance_abs: int, balance_rel: float) -> int:
    """The cache-aware rule (module docstring) over per-replica facts: ``matches`` in blocks,
    ``loads`` in requests, ``cached`` in blocks held. Raises NoReplica if none is alive."""
    live = [r for r, up in enumerate(alive) if up]
    if not live:
        raise NoReplica("every data-parallel replica has stopped")
    least = min(live, key=lambda r: (loads[r], cached[r], r))
    high, low = max(loads[r] for r in live), loads[least]
    if high - low > balance_abs and high > low * balance_rel:
        return least
    best = max(live, key=lambda r: (matches[r], -loads[r], -r))
    matched = min(matches[best] * block_size, prompt_len)
    if matches[best] == 0 or matched < threshold * prompt_len:
        return least
    return best


class Dispatcher:
    def __init__(self, num_replicas: int, block_size: int, *, policy: str = "cache_aware",
                 cache_threshold: float = 0.5, balance_abs: int = 32,
                 balance_rel: float = 1.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown dispatch policy {policy!r}")
        self.block_size = block_size
        self.policy = policy
        self.threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.replicas = [Replica(ReplicaCache(block_size)) for _ in range(num_replicas)]
        self.requests: dict[str, Routed] = {}
        self.sessions: dict[str, Session] = {}
        self._turn = itertools.cycle(range(num_replicas))
        self.changed = True  # since the last snapshot

    # ------------------------------------------------------------------ feeds
    def on_events(self, replica: int, sequence: int, payload: bytes) -> None:
        rep = self.replicas[replica]
        if rep.alive:
            rep.cache.apply(sequence, payload)
            self.changed = True

    def on_stats(self, replica: int, stats: SchedulerStats) -> None:
        self.replicas[replica].stats = stats
        self.changed = True

    def on_output(self, out: SeqOutput) -> None:
        routed = self.requests.get(out.rid)
        if routed is not None:
            routed.request = None
            if out.prompt_tokens:  # admitted: its cache hit is known
                routed.actual = out.cached_tokens

    # ---------------------------------------------------------------- routing
    def route(self, req: TokenizedRequest) -> tuple[int, float | None]:
        """The replica for a tokenized request, and the ttl to open its session with there
        first when the session has to move (its replica died), else None."""
        ids, session_id = unpack_ids(req.prompt_ids), req.session_id
        # An adapter's blocks hash under its content hash, which only the replicas know: its
        # requests go by load alone, and claim none of the base model's blocks.
        hashes = [] if req.lora_name is not None else chain_hashes(req.namespace, ids,
                                                                   self.block_size)
        reopen = None
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is not None and self.replicas[session.replica].alive:
            replica = session.replica
        else:
            replica = self._pick(hashes, len(ids))
            if session is not None:
                session.replica, reopen = replica, session.ttl
        rep = self.replicas[replica]
        predicted = min(rep.cache.match(hashes) * self.block_size, max(len(ids) - 1, 0))
        windows = rep.cache.add_coming(hashes, len(ids))
        rep.in_flight += 1
        rep.routed += 1
        self.requests[req.rid] = Routed(replica, hashes, windows, predicted, request=req)
        self.changed = True
        return replica, reopen

    def _pick(self, hashes: list[int], prompt_len: int) -> int:
        alive = [r.alive for r in self.replicas]
        if self.policy == "round_robin":
            if not any(alive):
                raise NoReplica("every data-parallel replica has stopped")
            return next(r for r in self._turn if alive[r])
        return choose([r.cache.match(hashes) for r in self.replicas],
                      [r.in_flight for r in self.replicas],
                      [r.cache.num_blocks for r in self.replicas], alive, self.block_size,
                      prompt_len, threshold=self.threshold,
                      balance_abs=self.balance_abs, balance_rel=self.balance_rel)

    def finish(self, rid: str) -> int | None:
        """The request left its replica (finished, failed or aborted): its replica, if known."""
        routed = self.requests.pop(rid, None)
        if routed is None:
            return None
        rep = self.replicas[routed.replica]
        rep.in_flight -= 1
        rep.cache.drop_coming(routed.hashes, routed.windows)
        if routed.actual >= 0:
            rep.predicted_cached_tokens += routed.predicted
            rep.actual_cached_tokens += routed.actual
        self.changed = True
        return routed.replica

    # --------------------------------------------------------------- sessions
    def open_session(self, session_id: str, ttl: float, parent: str | None = None) -> int:
        """Bind a new session to the least-loaded replica (it has no prompt yet), or a fork to
        its parent's (which holds its history's KV)."""
        home = self.sessions.get(parent) if parent is not None else None
        replica = home.replica if home is not None and self.replicas[home.replica].alive \
            else self._pick([], 0)
        self.sessions[session_id] = Session(replica, ttl)
        return replica

    def close_session(self, session_id: str) -> int | None:
        session = self.sessions.pop(session_id, None)
        return None if session is None else session.replica

    # ------------------------------------------------------------------ death
    def replica_down(self, replica: int) -> tuple[list[str], list[TokenizedRequest]]:
        """Stop routing to ``replica`` and drop its cache copy. Of the requests in flight there
        (all finished here now): the ids of those that had output already, for the caller to
        fail, and those that had none, for the caller to route again."""
        rep = self.replicas[replica]
        if not rep.alive:
            return [], []
        rep.alive = False
        rep.cache.drop()
        lost, again = [], []
        for rid in [rid for rid, routed in self.requests.items() if routed.replica == replica]:
            request = self.requests[rid].request
            self.finish(rid)
            if request is None:
                lost.append(rid)
            else:
                again.append(request)
        rep.cache.drop_all_coming()
        self.changed = True
        return lost, again

    def is_alive(self, replica: int) -> bool:
        return self.replicas[replica].alive

    def snapshot(self, tokenizer: int) -> DispatchStats:
        self.changed = False
        return DispatchStats(tokenizer, [r.load() for r in self.replicas])


class OneReplica:
    """A single engine's router: everything goes to replica 0, which never goes down, and
    nothing is tracked (no hashing, no reports), so one engine pays nothing for dispatch."""

    changed = False  # nothing to report

    def on_events(self, replica: int, sequence: int, payload: bytes) -> None:
        raise RuntimeError("a single engine publishes no KV events to its tokenizers")

    def on_stats(self, replica: int, stats: SchedulerStats) -> None:
        raise RuntimeError("a single engine's stats go to the frontend, not to a dispatcher")

    def on_output(self, out: SeqOutput) -> None:
        pass

    def route(self, req: TokenizedRequest) -> tuple[int, None]:
        return 0, None

    def finish(self, rid: str) -> int:
        return 0

    def open_session(self, session_id: str, ttl: float, parent: str | None = None) -> int:
        return 0

    def close_session(self, session_id: str) -> int:
        return 0

    def replica_down(self, replica: int) -> tuple[list[str], list[TokenizedRequest]]:
        raise RuntimeError("a single engine has no replica to lose")

    def is_alive(self, replica: int) -> bool:
        return True
