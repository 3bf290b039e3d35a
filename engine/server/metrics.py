"""Prometheus metrics of one server (its own registry, so several servers can share a process).

Frontend-side counters and latency histograms are updated as requests run; scheduler-side
gauges (running, waiting, KV pages, cache hits, preemptions, pinned sessions, speculative
decoding's drafts by method, structured output's requests, forced tokens and mask time, the
prefix cache's tiers: hits by tier, pages and bytes moved, transfer time, the disk tier on or
off) are read at scrape time from the last ``SchedulerStats`` the scheduler sent, so a scrape
costs no IPC. The KV cache's dtype, token capacity and bytes come from the worker's
``ModelInfo`` (``kv_cache_info``, vLLM's ``cache_config_info`` in spirit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.contracts.protocol import SchedulerStats
from engine.contracts.worker_messages import ModelInfo

PREFIX = "radixserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
DELIVERY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.006, 0.008, 0.012, 0.02,
                    0.04, 0.08, 0.16)


@dataclass
class FrontendState:
    """What the scheduler cannot know: the frontend's own queue, sessions and liveness."""

    pending: int
    sessions: int
    alive: bool


class _SchedulerCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats],
                 frontend: Callable[[], FrontendState], info: ModelInfo | None) -> None:
        self.stats = stats
        self.frontend = frontend
        self.info = info

    def collect(self) -> Iterator[Metric]:
        s, f = self.stats(), self.frontend()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield gauge("num_requests_running", "Sequences decoding or prefilling.", s.running)
        yield gauge("num_requests_waiting", "Requests queued in the scheduler.", s.waiting)
        yield gauge("num_requests_pending", "Requests in flight in the frontend.", f.pending)
        yield gauge("kv_pages_total", "KV pages in the device pool.", s.kv_pages_total)
        yield gauge("kv_pages_used", "KV pages held by running requests or pinned sessions.",
                    s.kv_pages_used)
        yield gauge("kv_pages_cached", "KV pages held only by the prefix cache (evictable).",
                    s.kv_pages_cached)
        if s.sliding_pages_total:
            yield from _sliding_pages(s)
        if self.info is not None:
            yield from _kv_cache(self.info, s.kv_pages_total)
        usage = s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0
        yield gauge("kv_cache_usage_ratio", "Fraction of KV pages in use (not evictable).", usage)
        rate = s.hit_tokens / s.queried_tokens if s.queried_tokens else 0.0
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the cache / looked up.", rate)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.",
                      s.hit_tokens)
        yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the cache.",
                      s.queried_tokens)
        yield counter("preemptions", "Requests preempted for lack of KV pages.", s.preemptions)
        yield gauge("sessions_open", "Open multi-turn sessions.", f.sessions)
        yield gauge("sessions_pinned", "Sessions whose KV is pinned.", s.sessions_pinned)
        yield gauge("pinned_tokens", "Tokens pinned by sessions.", s.pinned_tokens)
        yield gauge("engine_alive", "1 while every engine process runs.", float(f.alive))
        yield counter("structured_output_requests", "Requests admitted with a structured "
                      "output constraint.", s.constrained_requests)
        yield counter("structured_output_forced_tokens", "Tokens grammars forced (appended "
                      "without a step of their own).", s.grammar_forced_tokens)
        yield counter("structured_output_mask_seconds", "Host seconds filling token masks "
                      "(beside the forwards).", s.grammar_mask_seconds)
        if s.spec_method:
            yield from _speculation(s)
        if s.host_cache_pages_total or s.disk_block_tokens:
            yield from _tiers(s, self.info)


def _sliding_pages(s: SchedulerStats) -> Iterator[Metric]:
    """The sliding-window layers' own pages (--sliding-kv-ratio); the kv_pages_* gauges count
    the other layers' (every page of a context)."""
    yield GaugeMetricFamily(f"{PREFIX}_sliding_kv_pages_total", "KV pages of the "
                            "sliding-window layers.", value=s.sliding_pages_total)
    yield GaugeMetricFamily(f"{PREFIX}_sliding_kv_pages_used", "Sliding-window pages held by "
                            "running requests' windows or locked cached windows.",
                            value=s.sliding_pages_used)
    yield GaugeMetricFamily(f"{PREFIX}_sliding_kv_pages_cached", "Sliding-window pages of "
                            "windows only the prefix cache keeps (evictable).",
                            value=s.sliding_pages_cached)
    yield CounterMetricFamily(f"{PREFIX}_sliding_kv_evicted_pages", "Sliding-window pages "
                              "of cached windows evicted (their full KV stays cached).",
                              value=s.sliding_evicted_pages)
    yield CounterMetricFamily(f"{PREFIX}_sliding_kv_loaded_pages", "Sliding-window pages of "
                              "evicted cached windows read back from their host copies.",
                              value=s.sliding_loaded_pages)


def _kv_cache(info: ModelInfo, pages: int) -> Iterator[Metric]:
    """What the KV pool stores and holds: ``pages`` is the engine-wide page count (summed over
    data-parallel replicas, which share one model and page layout)."""
    labels = {"kv_cache_dtype": info.kv_cache_dtype or info.dtype,
              "page_size": str(info.page_size), "attention_backend": info.attention_backend}
    described = GaugeMetricFamily(f"{PREFIX}_kv_cache_info", "The KV cache's configuration "
                                  "(value 1).", labels=list(labels))
    described.add_metric(list(labels.values()), 1.0)
    yield described
    yield GaugeMetricFamily(f"{PREFIX}_kv_cache_capacity_tokens",
                            "Tokens the device KV pool holds.", value=pages * info.page_size)
    per_page = info.kv_cache_bytes / info.num_pages if info.num_pages else 0.0
    yield GaugeMetricFamily(f"{PREFIX}_kv_cache_bytes", "Bytes of the device KV pool (8-bit "
                            "caches' scales included).", value=pages * per_page)
    weights = GaugeMetricFamily(f"{PREFIX}_model_weight_bytes", "Bytes of the model's weights "
                                "by format: a dtype, or the block format of quantized ones "
                                "(--quantization); rank 0's share under tensor parallel.",
                                labels=["format"])
    for name, size in info.weight_bytes.items():
        weights.add_metric([name], float(size))
    yield weights
    forms = GaugeMetricFamily(f"{PREFIX}_linear_form_info", "How products over quantized "
                              "weights run (value 1), by weight (format, shape, activations' "
                              "dtype) and row count: blocks or widened (--linear-form).",
                              labels=["weight", "rows", "form"])
    for weight, choices in info.linear_forms.items():
        for rows, form in choices.items():
            forms.add_metric([weight, rows, form], 1.0)
    yield forms


def _tiers(s: SchedulerStats, info: ModelInfo | None) -> Iterator[Metric]:
    """The prefix cache by tier (``--host-cache-gb``, ``--disk-cache-dir``): where hits were
    found, and what moved between the tiers."""
    hits = CounterMetricFamily(f"{PREFIX}_prefix_cache_tier_hit_tokens", "Prompt tokens found "
                               "in the prefix cache, by the tier that held them.",
                               labels=["tier"])
    hits.add_metric(["device"], s.hit_tokens - s.host_hit_tokens)
    if s.host_cache_pages_total:
        hits.add_metric(["host"], s.host_hit_tokens)
    if s.disk_block_tokens:
        hits.add_metric(["disk"], s.disk_hit_tokens)
    yield hits
    if s.host_cache_pages_total:
        yield from _host_tier(s, info)
    if s.disk_block_tokens:
        yield from _disk_tier(s)


def _disk_tier(s: SchedulerStats) -> Iterator[Metric]:
    yield GaugeMetricFamily(f"{PREFIX}_disk_cache_on", "1 while the disk tier serves (0: its "
                            "directory could not be set up, a full disk, and is tried again "
                            "later, or it is gone); engines summed.", value=s.disk_on)
    blocks = CounterMetricFamily(f"{PREFIX}_disk_cache_blocks", "Disk-tier blocks sent to be "
                                 "saved (save) and loaded (load).", labels=["direction"])
    blocks.add_metric(["save"], s.disk_blocks_saved)
    blocks.add_metric(["load"], s.disk_blocks_loaded)
    yield blocks
    moved = CounterMetricFamily(f"{PREFIX}_disk_cache_bytes_moved", "Bytes read from and "
                                "written to the disk tier's files.", labels=["direction"])
    moved.add_metric(["read"], s.disk_bytes_read)
    moved.add_metric(["write"], s.disk_bytes_written)
    yield moved
    yield CounterMetricFamily(f"{PREFIX}_disk_cache_load_seconds", "Seconds the worker's I/O "
                              "thread spent reading blocks into pages.", value=s.disk_load_seconds)
    yield CounterMetricFamily(f"{PREFIX}_disk_cache_load_failures", "Loads that ended early (a "
                              "block missing or failing a check); the rest was recomputed.",
                              value=s.disk_load_failures)
    yield CounterMetricFamily(f"{PREFIX}_disk_cache_rejected_files", "Corrupt, truncated or "
                              "foreign files skipped and removed.", value=s.disk_rejected_files)


def _host_tier(s: SchedulerStats, info: ModelInfo | None) -> Iterator[Metric]:
    """The host tier's pages, and the pages (and bytes) moved between it and the device."""
    yield GaugeMetricFamily(f"{PREFIX}_host_cache_pages_total", "Pages of the host tier.",
                            value=s.host_cache_pages_total)
    yield GaugeMetricFamily(f"{PREFIX}_host_cache_pages_used", "Pages of the host tier holding "
                            "KV.", value=s.host_cache_pages_used)
    if s.host_cache_sliding_pages_total:
        yield GaugeMetricFamily(f"{PREFIX}_host_cache_sliding_pages_total", "Pages of the host "
                                "tier for the sliding-window layers' kept windows.",
                                value=s.host_cache_sliding_pages_total)
        yield GaugeMetricFamily(f"{PREFIX}_host_cache_sliding_pages_used", "Of those, pages "
                                "holding a window.", value=s.host_cache_sliding_pages_used)
    per_page = info.kv_cache_bytes / info.num_pages if info is not None and info.num_pages else 0
    moved = [("write", s.host_pages_written), ("load", s.host_pages_loaded)]
    pages = CounterMetricFamily(f"{PREFIX}_host_cache_pages_moved", "KV pages copied down to "
                                "the host tier (write) and loaded back (load).",
                                labels=["direction"])
    moved_bytes = CounterMetricFamily(f"{PREFIX}_host_cache_bytes_moved", "Bytes of those "
                                      "pages.", labels=["direction"])
    for direction, count in moved:
        pages.add_metric([direction], count)
        moved_bytes.add_metric([direction], count * per_page)
    yield pages
    yield moved_bytes
    yield CounterMetricFamily(f"{PREFIX}_host_transfer_seconds", "Worker seconds issuing the "
                              "steps' page copies between host and device (the host tier's "
                              "writes and loads, and swaps).", value=s.host_transfer_seconds)


def _speculation(s: SchedulerStats) -> Iterator[Metric]:
    """Speculative decoding's counters (scheduler/speculation.py), labelled by method."""

    def family(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str,
               value: float) -> Metric:
        metric = kind(f"{PREFIX}_{name}", doc, labels=["method"])
        metric.add_metric([s.spec_method], value)
        return metric

    yield family(CounterMetricFamily, "spec_decode_num_draft_tokens",
                 "Draft tokens verified.", s.spec_drafted_tokens)
    yield family(CounterMetricFamily, "spec_decode_num_accepted_tokens",
                 "Draft tokens accepted.", s.spec_accepted_tokens)
    yield family(CounterMetricFamily, "spec_decode_num_emitted_tokens",
                 "Tokens produced by verification steps (accepted drafts plus one each).",
                 s.spec_emitted_tokens)
    yield family(CounterMetricFamily, "spec_decode_num_verifications",
                 "Sequence-steps that verified drafts.", s.spec_verifications)
    if s.spec_method == "draft_model":
        yield family(CounterMetricFamily, "spec_decode_draft_model_num_draft_tokens",
                     "Draft tokens the draft model proposed and the model verified.",
                     s.spec_model_drafted_tokens)
        yield family(CounterMetricFamily, "spec_decode_draft_model_num_accepted_tokens",
                     "Of those, accepted.", s.spec_model_accepted_tokens)
        yield family(CounterMetricFamily, "spec_decode_draft_model_pauses",
                     "Times a sequence stopped drafting with the draft model for a while "
                     "(its drafts did not pay for their cost).", s.spec_model_pauses)
        yield family(CounterMetricFamily, "spec_decode_draft_model_off_steps",
                     "Sequence-steps without the draft model because steps at their batch "
                     "size measured more output tokens per second without it.",
                     s.spec_model_off_steps)
    drafted, verified = s.spec_drafted_tokens, s.spec_verifications
    yield family(GaugeMetricFamily, "spec_decode_acceptance_rate",
                 "Accepted / drafted tokens.", s.spec_accepted_tokens / drafted if drafted else 0.0)
    yield family(GaugeMetricFamily, "spec_decode_mean_accepted_length",
                 "Accepted drafts per verification.",
                 s.spec_accepted_tokens / verified if verified else 0.0)


class Metrics:
    def __init__(self, stats: Callable[[], SchedulerStats],
                 frontend: Callable[[], FrontendState], info: ModelInfo | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "API requests answered, by endpoint and "
                                "status.", ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=self.registry)
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens", "Prompt tokens of "
                                     "finished requests served from the cache.",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.",
                                         registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first "
                              "token.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between "
                             "consecutive tokens of a stream.", buckets=TOKEN_GAP_BUCKETS,
                             registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_request_latency_seconds", "Arrival to last token.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.delivery = Histogram(f"{PREFIX}_token_delivery_seconds", "From the scheduler "
                                  "getting a step's result to the frontend handing its tokens "
                                  "to the response: the hops through the tokenizer worker.",
                                  buckets=DELIVERY_BUCKETS, registry=self.registry)
        # LoRA adapters (--enable-lora): the same counts for each adapter's requests
        self.lora_requests = Counter(f"{PREFIX}_lora_requests", "API requests answered under "
                                     "a LoRA adapter, by adapter and status.",
                                     ["adapter", "status"], registry=self.registry)
        self.lora_prompt_tokens = Counter(f"{PREFIX}_lora_prompt_tokens", "Prompt tokens of "
                                          "finished requests, by LoRA adapter.", ["adapter"],
                                          registry=self.registry)
        self.lora_cached_tokens = Counter(f"{PREFIX}_lora_cached_prompt_tokens", "Of those, "
                                          "served from the adapter's own cache.", ["adapter"],
                                          registry=self.registry)
        self.lora_generation_tokens = Counter(f"{PREFIX}_lora_generation_tokens", "Generated "
                                              "tokens, by LoRA adapter.", ["adapter"],
                                              registry=self.registry)
        self.registry.register(_SchedulerCollector(stats, frontend, info))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, endpoint: str, adapter: str | None = None) -> RequestTimer:
        return RequestTimer(self, endpoint, adapter)


class RequestTimer:
    """Times one API request's token deliveries (per choice) and records its outcome once."""

    def __init__(self, metrics: Metrics, endpoint: str, adapter: str | None = None) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.adapter = adapter  # the LoRA adapter the request runs under, if any
        self.start = time.monotonic()
        self.last: dict[int, float] = {}  # choice → when its last token came
        self.done = False

    def tokens(self, choice: int, count: int, result_at: float = 0.0) -> None:
        """``count`` tokens of ``choice`` delivered now; ``result_at``: when the scheduler got
        the step result they come from (monotonic, the same clock in every process)."""
        if count <= 0:
            return
        now = time.monotonic()
        if result_at:
            self.metrics.delivery.observe(now - result_at)
        if not self.last:
            self.metrics.ttft.observe(now - self.start)
        last = self.last.get(choice)
        if last is not None:
            # One delivery can hold several tokens (text held back for a stop string).
            gap = (now - last) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self.last[choice] = now

    def finish(self, status: int, prompt: int = 0, cached: int = 0, generated: int = 0) -> None:
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.requests.labels(self.endpoint, str(status)).inc()
        if status == 200:
            m.latency.observe(time.monotonic() - self.start)
            m.prompt_tokens.inc(prompt)
            m.cached_tokens.inc(cached)
            m.generation_tokens.inc(generated)
        if self.adapter is None:
            return
        m.lora_requests.labels(self.adapter, str(status)).inc()
        if status == 200:
            m.lora_prompt_tokens.labels(self.adapter).inc(prompt)
            m.lora_cached_tokens.labels(self.adapter).inc(cached)
            m.lora_generation_tokens.labels(self.adapter).inc(generated)
