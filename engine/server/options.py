"""The server's own options (its doors and their limits), declared once as the engine's are
(engine/contracts/options.py): ``radixserve serve``'s flags, their help, their checks and every
door's defaults come from here."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from engine.contracts.options import check_declared


class ServeOptions(msgspec.Struct, kw_only=True):
    host: Annotated[str, Meta(description=(
        "address to listen on; 0.0.0.0 exposes the server to the network (default: this "
        "machine only)"))] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="HTTP port")] = 30000
    api_key: Annotated[str, Meta(extra={"env": "RADIXSERVE_API_KEY"}, description=(
        "require 'Authorization: Bearer KEY' on the API routes and /metrics, api_key KEY in "
        "every ZMQ call and 'authorization: Bearer KEY' metadata on every gRPC call (default: "
        "$RADIXSERVE_API_KEY, else no key)"))] | None = None
    metrics_open: Annotated[bool, Meta(description=(
        "serve /metrics without the API key (default: behind it)"))] = False
    zmq_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "also serve the ZMQ front door on this TCP port, on the --host address"))
        ] | None = None
    grpc_port: Annotated[int, Meta(ge=0, le=65535, description=(
        "also serve smg's worker gRPC service (vllm.grpc.engine.VllmEngine: token ids in and "
        "out, health, loads, KV events) on this TCP port, on the --host address, for `smg "
        "launch --worker-urls grpc://HOST:PORT`; publishes KV events on a private ipc:// "
        "endpoint unless --kv-events-endpoint is given; needs the grpc extra"))] | None = None
    max_request_bytes: Annotated[int, Meta(ge=1, description=(
        "largest request body (HTTP) or message (ZMQ); bigger ones get 413"))] = 8 << 20
    max_inflight_requests: Annotated[int, Meta(ge=1, description=(
        "engine requests admitted by the doors and not yet finished; past it new ones get "
        "503"))] = 4096
    default_max_tokens: Annotated[int, Meta(ge=1, description=(
        "max_tokens of a chat or gRPC request that sets none"))] = 256
    salt_from_user: Annotated[bool, Meta(description=(
        "use each request's OpenAI 'user' field as its cache salt: different users never "
        "share cached prompt prefixes; a request's cache_salt then splits its user's cache "
        "further"))] = False
    tool_call_parser: Annotated[Literal["hermes"], Meta(description=(
        "read tool calls out of the text a chat request with tools and tool_choice \"auto\" "
        "generates: hermes takes <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> "
        "blocks (Hermes, Qwen 2.5 and later); without it such a request is refused (default: "
        "none)"))] | None = None
    enable_runtime_lora_updating: Annotated[bool, Meta(description=(
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies; behind "
        "the API key), which read adapters from paths on this machine a client names; needs "
        "--enable-lora"))] = False
    shutdown_timeout: Annotated[float, Meta(ge=0, description=(
        "seconds running requests get to finish after SIGTERM / SIGINT before they are failed "
        "with 503"))] = 30.0

    def validate(self) -> None:
        check_declared(self)
