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
    seed: int = 0
    # scheduling
    policy: str = "lpm"
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    preemption_mode: str = "recompute"
    max_queued_requests: int = 4096
    context_len: int | None = None  # defaults to the model's
    # sessions
    max_sessions: int = 1024
    session_ttl: float = 300.0
    max_pinned_tokens: int | None = None  # defaults to half the KV pool
    # processes
    tokenizer_workers: int = 1
    # KV cache events for gateways (scheduler/kv_events.py): a ZMQ PUB endpoint, and the block
    # size their hashes cover (default: the page size)
    kv_events_endpoint: str | None = None
    kv_events_block_size: int | None = None
    # Chat text that spells a special token (<|im_end|>) is encoded as text, so a user cannot
    # forge a turn; set this only when every client is trusted with control tokens.
    allow_special_tokens_in_content: bool = False
    log_level: str = "warning"

    def serving_context_len(self, model_context_len: int) -> int:
        """The context requests get: ``--context-len`` if given, else the model's."""
        return self.context_len or model_context_len

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
        for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size",
                     "tokenizer_workers", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(
                ("tcp://", "ipc://")):
            raise ValueError("--kv-events-endpoint must be a tcp:// or ipc:// ZMQ address such "
                             f"as tcp://*:5557, got {self.kv_events_endpoint!r}")
        if self.kv_events_block_size is not None:
            if self.kv_events_endpoint is None:
                raise ValueError("--kv-events-block-size needs --kv-events-endpoint")
            if self.kv_events_block_size < 1:
                raise ValueError(
                    f"--kv-events-block-size must be at least 1, got {self.kv_events_block_size}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(
                f"--attention-backend must be auto, torch or flashinfer, got {self.attention_backend!r}"
            )


class Endpoints(msgspec.Struct, kw_only=True):
    """ZeroMQ addresses of one launch (``ipc://`` paths in a private 0700 directory)."""

    control: str  # children → launcher
    tokenizer_in: list[str]  # frontend → tokenizer i
    tokenizer_from_scheduler: list[str]  # scheduler → tokenizer i
    frontend_in: str  # tokenizers → frontend
    scheduler_in: str  # tokenizers → scheduler
    worker_in: str  # scheduler → worker
    worker_out: str  # worker → scheduler


class LaunchSpec(msgspec.Struct, kw_only=True):
    role: str  # "worker" | "scheduler" | "tokenizer"
    index: int = 0
    config: EngineConfig
    endpoints: Endpoints
