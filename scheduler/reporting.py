"""What the scheduler reports (``SchedulerStats``, /metrics): running and waiting requests, the
pages of each pool, hits, preemptions, sessions, structured output, and the host and disk
tiers' counts. A mixin of ``Scheduler``, reading its state."""

from __future__ import annotations

from scheduler.kv import sliding_stats


class Reporting:
    def stats(self) -> dict[str, float | str]:
        s = self.tree.stats
        return {
            **(self.speculator.stats() if self.speculator is not None else {}),
            "running": sum(len(r.live_seqs()) for r in self.running),
            "waiting": len(self.waiting),
            "kv_pages_total": self.alloc.num_pages,
            "kv_pages_used": self.alloc.num_pinned_pages,
            "kv_pages_cached": self.alloc.num_evictable_pages,
            **sliding_stats(self.tree),
            "hit_tokens": s.hit_tokens + (self.disk.hit_tokens if self.disk is not None else 0),
            "queried_tokens": s.queried_tokens,
            "preemptions": self.num_preemptions,
            "sessions_pinned": len(self.sessions.pins),
            "pinned_tokens": self.sessions.pinned_tokens,
            "constrained_requests": self.constrained_requests,
            "grammar_forced_tokens": self.grammar_forced_tokens,
            "grammar_mask_seconds": self.grammar_mask_seconds,
            **(self._host_stats() if self.host is not None else {}),
            **(self._disk_stats() if self.disk is not None else {}),
        }

    def _disk_stats(self) -> dict[str, float]:
        io = self.disk_io
        return {**self.disk.stats(), "disk_bytes_read": io.disk_bytes_read,
                "disk_bytes_written": io.disk_bytes_written,
                "disk_load_seconds": io.disk_load_seconds, "disk_rejected_files": io.disk_rejected}

    def _host_stats(self) -> dict[str, float]:
        host, s = self.host.allocator, self.tree.stats
        return {
            "host_cache_pages_total": host.num_pages,
            "host_cache_pages_used": host.num_pages - host.num_free_pages,
            **({"host_cache_sliding_pages_total": self.host.swa.num_pages,
                "host_cache_sliding_pages_used": self.host.swa.num_pages
                - self.host.swa.num_free_pages} if self.host.swa is not None else {}),
            "host_hit_tokens": s.host_hit_tokens,
            "host_pages_written": s.pages_written,
            "host_pages_loaded": s.pages_loaded,
            "host_transfer_seconds": self.transfer_seconds,
        }

