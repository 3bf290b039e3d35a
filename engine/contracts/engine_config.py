"""Engine options: one Struct that the launcher hands every child process (as msgpack on stdin)."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str  # a local Hugging Face directory (the demo model's, when the user gave none)
    served_model_name: str | None = None
    # KV memory
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_gb: float | None = None
    mem_fraction: float = 0.85
    num_host_pages: int = 0
    # the model runner
    device: str | None = None
    dtype: str | None = None
    attention_backend: str = "auto"
    # FlashInfer's decode kernel on tensor cores: fa2 (default: on Hopper, auto means FA3, which
    # is slower for decode), fa3 or auto (FlashInfer's own choice)
    flashinfer_decode_backend: str = "fa2"
    # CUDA graphs for decode steps (flashinfer backend only), captured at start for batch sizes
    # up to cuda_graph_max_bs; off until scripts/gpu_check.sh has shown them token-identical
    enable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    # weights: auto reads the checkpoint; dummy fills random weights on the device from the
    # config alone (benchmarks of large shapes without the files, like vLLM's --load-format)
    load_format: str = "auto"
    seed: int = 0
    # scheduling
    policy: str = "lpm"
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    preemption_mode: str = "recompute"
    max_queued_requests: int = 4096
    # plan step k+1 while the worker runs step k: on, off, or auto (on when the model runs on a
    # GPU; off on CPU, where the forward uses every core and a new request would wait a step)
    overlap_schedule: str = "auto"
    context_len: int | None = None  # defaults to the model's
    # sessions
    max_sessions: int = 1024
    session_ttl: float = 300.0
    max_pinned_tokens: int | None = None  # defaults to half the KV pool
    # processes
    tokenizer_workers: int = 1
    # CPU threads of each model worker process (default: its share of the cores)
    worker_threads: int | None = None
    # KV cache events for gateways (scheduler/kv_events.py): a ZMQ PUB endpoint, and the block
    # size their hashes cover (default: the page size)
    kv_events_endpoint: str | None = None
    kv_events_block_size: int | None = None
    # data parallel (tokenizer_worker/dispatch.py): replicas (a scheduler + worker each, with
    # its own KV pool), how requests are spread over them, and the cache-aware rule's limits
    dp_size: int = 1
    dp_policy: str = "cache_aware"
    dp_cache_threshold: float = 0.5
    dp_balance_abs: int = 32
    dp_balance_rel: float = 1.5
    # tensor parallel (engine/worker/distributed.py): ranks sharing each layer's heads and MLP, how
    # many machines they span (tp_size / nnodes ranks each), this machine's place, and where
    # they meet (HOST:PORT on node 0; default on one machine: a free port on 127.0.0.1)
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Chat text that spells a special token (<|im_end|>) is encoded as text, so a user cannot
    # forge a turn; set this only when every client is trusted with control tokens.
    allow_special_tokens_in_content: bool = False
    log_level: str = "warning"

    def serving_context_len(self, model_context_len: int) -> int:
        """The context requests get: ``--context-len`` if given, else the model's."""
        return self.context_len or model_context_len

    @property
    def tp_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def kv_events_block(self) -> int:
        """Tokens per block of the KV events."""
        return self.kv_events_block_size or self.page_size

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"--page-size must be at least 1, got {self.page_size}")
        if self.policy not in ("lpm", "fcfs"):
            raise ValueError(f"--policy must be 'lpm' or 'fcfs', got {self.policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"--preemption-mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and self.num_host_pages < 1:
            raise ValueError("--preemption-mode swap needs --num-host-pages > 0")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise ValueError(f"--worker-threads must be at least 1, got {self.worker_threads}")
        for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size",
                     "tokenizer_workers", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(
                ("tcp://", "ipc://")):
            raise ValueError("--kv-events-endpoint must be a tcp:// or ipc:// ZMQ address such "
                             f"as tcp://*:5557, got {self.kv_events_endpoint!r}")
        if self.kv_events_block_size is not None:
            if self.kv_events_endpoint is None and self.dp_size == 1:
                raise ValueError("--kv-events-block-size needs --kv-events-endpoint (or "
                                 "--dp-size > 1, whose dispatcher reads the events)")
            if self.kv_events_block_size < 1:
                raise ValueError(
                    f"--kv-events-block-size must be at least 1, got {self.kv_events_block_size}")
        self._validate_dp()
        self._validate_tp()
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(
                f"--attention-backend must be auto, torch or flashinfer, got {self.attention_backend!r}"
            )
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"--overlap-schedule must be auto, on or off, got "
                             f"{self.overlap_schedule!r}")
        if self.flashinfer_decode_backend not in ("fa2", "fa3", "auto"):
            raise ValueError("--flashinfer-decode-backend must be fa2, fa3 or auto, got "
                             f"{self.flashinfer_decode_backend!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {self.cuda_graph_max_bs}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")

    def _validate_dp(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be at least 1, got {self.dp_size}")
        if self.dp_policy not in ("cache_aware", "round_robin"):
            raise ValueError("--dp-policy must be 'cache_aware' or 'round_robin', got "
                             f"{self.dp_policy!r}")
        if not 0.0 <= self.dp_cache_threshold <= 1.0:
            raise ValueError("--dp-cache-threshold is a fraction of the prompt, from 0 to 1, "
                             f"got {self.dp_cache_threshold}")
        if self.dp_balance_abs < 0:
            raise ValueError(f"--dp-balance-abs must be 0 or more, got {self.dp_balance_abs}")
        if not self.dp_balance_rel >= 1.0:
            raise ValueError(f"--dp-balance-rel must be at least 1, got {self.dp_balance_rel}")
        if self.dp_size > 1 and self.kv_events_endpoint is not None:
            # Each replica publishes to the dispatcher on its own ipc:// endpoint; one
            # user endpoint cannot be bound by several replicas.
            raise ValueError("--kv-events-endpoint publishes one engine's events; with "
                             "--dp-size > 1 the replicas publish to the dispatcher instead "
                             "(run one radixserve serve per engine behind a gateway to use it)")


    def _validate_tp(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes must divide --tp-size ({self.tp_size}): each machine "
                             f"runs the same number of ranks; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be from 0 to --nnodes - 1 ({self.nnodes - 1}), "
                             f"got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT, an address of "
                             "node 0 that every node can reach")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("--dist-init-addr must be HOST:PORT (node 0's address), got "
                                 f"{self.dist_init_addr!r}")
        if self.tp_size > 1 and self.dp_size > 1:
            raise ValueError("--tp-size > 1 with --dp-size > 1 is not supported: run one "
                             "radixserve serve per tensor-parallel engine behind a gateway")


class ReplicaEndpoints(msgspec.Struct, kw_only=True):
    """One data-parallel replica's addresses (a scheduler and its worker)."""

    scheduler_in: str  # tokenizers → this scheduler
    tokenizer_from_scheduler: list[str]  # this scheduler → tokenizer i
    worker_in: str
    worker_out: str
    kv_events: str | None = None  # this scheduler's KV events → the tokenizers' dispatchers


class Endpoints(msgspec.Struct, kw_only=True):
    """ZeroMQ addresses of one launch (``ipc://`` paths in a private 0700 directory)."""

    control: str  # children → launcher
    tokenizer_in: list[str]  # frontend → tokenizer i
    tokenizer_from_scheduler: list[str]  # scheduler → tokenizer i
    frontend_in: str  # tokenizers → frontend
    scheduler_in: str  # tokenizers → scheduler
    worker_in: str  # scheduler → worker
    worker_out: str  # worker → scheduler
    # --dp-size > 1: every replica's addresses (the fields above are replica 0's), and where
    # the tokenizers' dispatchers send their per-replica counters (the frontend's metrics)
    replicas: list[ReplicaEndpoints] = []
    dispatch_stats: str | None = None

    def for_replica(self, index: int) -> Endpoints:
        """The addresses replica ``index``'s scheduler and worker use: its own in the fields
        a single engine reads, so those processes need not know about replicas."""
        rep = self.replicas[index]
        return msgspec.structs.replace(
            self, scheduler_in=rep.scheduler_in, worker_in=rep.worker_in,
            worker_out=rep.worker_out, tokenizer_from_scheduler=rep.tokenizer_from_scheduler)


class LaunchSpec(msgspec.Struct, kw_only=True):
    role: str  # "worker" | "scheduler" | "tokenizer"
    index: int = 0
    config: EngineConfig
    endpoints: Endpoints
