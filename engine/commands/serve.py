"""``radixserve serve``: the OpenAI-compatible HTTP server (and optional ZMQ and gRPC doors)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from engine.commands.options import (
    add_declared_arguments,
    add_engine_arguments,
    config_from_args,
    declared_from_args,
)
from engine.server.options import ServeOptions

if TYPE_CHECKING:
    from engine.contracts.engine_config import EngineConfig

HELP = "serve a model over an OpenAI-compatible HTTP API (and optionally ZMQ and gRPC)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_declared_arguments(parser, "server", ServeOptions)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        options = declared_from_args(args, ServeOptions)
        config = config_from_args(args)
    except ValueError as exc:
        print(f"radixserve serve: {exc}", file=sys.stderr)
        return 2
    if options.grpc_port is not None:
        refusal = _grpc_refusal(config)
        if refusal is not None:
            print(f"radixserve serve: {refusal}", file=sys.stderr)
            return 2
    from engine.server.frontend import serve

    return serve(config, options)


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
