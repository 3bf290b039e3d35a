"""``radixserve serve``: the OpenAI-compatible HTTP server (and optional ZMQ front door)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from engine.commands.options import add_engine_arguments, config_from_args

if TYPE_CHECKING:
    from engine.contracts.engine_config import EngineConfig

HELP = "serve a model over an OpenAI-compatible HTTP API (and optionally ZMQ)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 exposes the server to the network "
                            "(default: 127.0.0.1, this machine only)")
    group.add_argument("--port", type=int, default=30000, help="HTTP port (default: 30000)")
    group.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on the API routes and /metrics, "
                            "and api_key KEY in every ZMQ call (default: $RADIXSERVE_API_KEY, "
                            "else no key)")
    group.add_argument("--metrics-open", action="store_true",
                       help="serve /metrics without the API key (default: behind it)")
    group.add_argument("--zmq-port", type=int, default=None,
                       help="also serve the ZMQ front door on this TCP port, on the --host "
                            "address (default: off)")
    group.add_argument("--grpc-port", type=int, default=None,
                       help="also serve smg's worker gRPC service (vllm.grpc.engine.VllmEngine: "
                            "token ids in and out, health, loads, KV events) on this TCP port, "
                            "on the --host address, for `smg launch --worker-urls "
                            "grpc://HOST:PORT`; publishes KV events on a private ipc:// "
                            "endpoint unless --kv-events-endpoint is given; needs the grpc "
                            "extra (default: off)")
    group.add_argument("--max-request-bytes", type=int, default=8 << 20,
                       help="largest request body; bigger ones get 413 (default: 8 MiB)")
    group.add_argument("--max-pending-requests", type=int, default=4096,
                       help="engine requests in flight before new ones get 503 (default: 4096)")
    group.add_argument("--default-max-tokens", type=int, default=256,
                       help="max_tokens of a chat request that sets none (default: 256)")
    group.add_argument("--salt-from-user", action="store_true",
                       help="use each request's OpenAI 'user' field as its cache salt: "
                            "different users never share cached prompt prefixes; a request's "
                            "cache_salt then splits its user's cache further (default: off)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM / SIGINT "
                            "before they are failed with 503 (default: 30)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    for name in ("max_request_bytes", "max_pending_requests", "default_max_tokens"):
        if getattr(args, name) < 1:
            print(f"radixserve serve: --{name.replace('_', '-')} must be at least 1",
                  file=sys.stderr)
            return 2
    if not args.shutdown_timeout >= 0:
        print("radixserve serve: --shutdown-timeout must be 0 or more seconds", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"radixserve serve: {exc}", file=sys.stderr)
        return 2
    if args.grpc_port is not None:
        refusal = _grpc_refusal(config)
        if refusal is not None:
            print(f"radixserve serve: {refusal}", file=sys.stderr)
            return 2
    from engine.server.frontend import ServeOptions, serve

    return serve(config, ServeOptions(
        host=args.host, port=args.port, api_key=args.api_key, zmq_port=args.zmq_port,
        grpc_port=args.grpc_port,
        max_request_bytes=args.max_request_bytes,
        max_pending_requests=args.max_pending_requests,
        default_max_tokens=args.default_max_tokens, shutdown_timeout=args.shutdown_timeout,
        salt_from_user=args.salt_from_user, metrics_open=args.metrics_open,
    ))


def _grpc_refusal(config: EngineConfig) -> str | None:
    """Why --grpc-port cannot serve this configuration, or None."""
    from engine.contracts.kv_events import binds

    if config.dp_size > 1:
        return ("--grpc-port relays one engine's KV events and --dp-size > 1 runs several; run "
                "one radixserve serve per engine behind smg instead")
    if config.kv_events_endpoint is not None and not binds(config.kv_events_endpoint):
        return (f"--grpc-port subscribes to the KV events, so --kv-events-endpoint must be an "
                f"address this server binds (tcp://*:PORT or ipc://PATH), not "
                f"{config.kv_events_endpoint!r}")
    return None
