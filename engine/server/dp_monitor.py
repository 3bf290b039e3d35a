"""The frontend's view of data-parallel dispatch (``--dp-size`` > 1), for ``/metrics``.

Every tokenizer worker's dispatcher reports its replicas (``DispatchStats``: load, routed
requests, predicted vs actual cached tokens, the replica scheduler's stats) on a socket of its
own, a few times a second while anything changes. This keeps the latest report of each and
sums them per replica; a scrape costs no IPC. The engine-wide scheduler gauges of a single
engine become the sum over the replicas' latest stats.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.contracts.protocol import DispatchStats, SchedulerStats

PREFIX = "radixserve_dp"


@dataclass
class ReplicaView:
    """One replica summed over the tokenizer workers' dispatchers."""

    alive: bool = True
    in_flight: int = 0
    routed: int = 0
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    cached_blocks: int = 0
    resets: int = 0


class DispatchReports:
    """The latest report of every tokenizer worker, summed per replica (no sockets)."""

    def __init__(self, num_replicas: int, num_pages: int) -> None:
        self.num_replicas = num_replicas
        self.reports: dict[int, DispatchStats] = {}  # tokenizer → its latest report
        # Each replica scheduler's latest stats (whichever tokenizer it last sent them to);
        # until a replica has worked, its pool is whole and free.
        self.stats = [SchedulerStats(kv_pages_total=num_pages) for _ in range(num_replicas)]

    def add(self, report: DispatchStats) -> None:
        before = self.reports.get(report.tokenizer)
        for r, load in enumerate(report.replicas):
            seen = before.replicas[r].stats if before is not None else None
            if load.stats is not None and load.stats != seen:
                self.stats[r] = load.stats
        self.reports[report.tokenizer] = report

    def replicas(self) -> list[ReplicaView]:
        views = [ReplicaView() for _ in range(self.num_replicas)]
        for report in self.reports.values():
            for view, load in zip(views, report.replicas, strict=True):
                view.alive = view.alive and load.alive
                view.in_flight += load.in_flight
                view.routed += load.routed
                view.predicted_cached_tokens += load.predicted_cached_tokens
                view.actual_cached_tokens += load.actual_cached_tokens
                view.cached_blocks = max(view.cached_blocks, load.cached_blocks)
                view.resets += load.resets
        return views

    def total_stats(self) -> SchedulerStats:
        """The replicas' scheduler stats summed: the engine-wide gauges of ``/metrics``.
        A field that is not a number (a name the replicas share) is replica 0's."""
        fields = msgspec.structs.fields(SchedulerStats)
        return SchedulerStats(**{
            f.name: sum(getattr(s, f.name) for s in self.stats)
            if f.type in (int, float) else getattr(self.stats[0], f.name) for f in fields})

    def collector(self) -> Collector:
        return _DispatchCollector(self)


class DispatchMonitor:
    """Receives the reports on the frontend's event loop."""

    def __init__(self, address: str, num_replicas: int, num_pages: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(address)
        self.reports = DispatchReports(num_replicas, num_pages)
        self._decoder = msgspec.msgpack.Decoder(DispatchStats)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            self.reports.add(self._decoder.decode(await self.inbox.recv()))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.ctx.destroy(linger=0)


class _DispatchCollector(Collector):
    def __init__(self, reports: DispatchReports) -> None:
        self.reports = reports

    def collect(self) -> Iterator[Metric]:
        views, stats = self.reports.replicas(), self.reports.stats

        def family(kind: type, name: str, doc: str, values: list[float]) -> Metric:
            metric = kind(f"{PREFIX}_{name}", doc, labels=["replica"])
            for r, value in enumerate(values):
                metric.add_metric([str(r)], value)
            return metric

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "replica_alive", "1 while the replica's scheduler and worker run.",
                     [float(v.alive) for v in views])
        yield family(g, "requests_in_flight", "Requests dispatched to the replica and not yet "
                     "finished (its load).", [v.in_flight for v in views])
        yield family(c, "requests_routed", "Requests dispatched to the replica.",
                     [v.routed for v in views])
        yield family(c, "predicted_cached_tokens", "Prompt tokens the dispatcher expected the "
                     "replica to find cached (finished requests).",
                     [v.predicted_cached_tokens for v in views])
        yield family(c, "actual_cached_tokens", "Prompt tokens the replica found cached, as it "
                     "reported them (the same requests).", [v.actual_cached_tokens for v in views])
        yield family(g, "cached_blocks", "Blocks in the dispatcher's copy of the replica's cache.",
                     [v.cached_blocks for v in views])
        yield family(c, "cache_resets", "Times the dispatcher dropped its copy of the replica's "
                     "cache (a gap in its KV events, or the replica stopped).",
                     [v.resets for v in views])
        yield family(g, "num_requests_running", "Sequences decoding or prefilling on the replica.",
                     [s.running for s in stats])
        yield family(g, "num_requests_waiting", "Requests queued in the replica's scheduler.",
                     [s.waiting for s in stats])
        yield family(g, "kv_pages_used", "KV pages of the replica in use (not evictable).",
                     [s.kv_pages_used for s in stats])
