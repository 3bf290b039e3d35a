"""``radixserve chat``: an interactive terminal chat over a server-side session.

With ``--url`` it talks to a running server; otherwise it starts one (``radixserve serve`` on
``--port``, a free loopback port by default, with ``--model`` or the default model) and stops
it on exit. Each turn sends
only the new message: the server keeps the conversation's tokens, so the line after each reply
shows the whole history as cached tokens, with the time to the first token. Ctrl-C stops a
reply (the turn is dropped); Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import argparse
import os
import sys

HELP = "chat in the terminal over a multi-turn session (starts a server unless --url)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running radixserve server, e.g. http://127.0.0.1:30000 "
                                      "(default: start one)")
    parser.add_argument("--model", help="--model of the server this command starts: a "
                                        "checkpoint directory, a .gguf file or 'demo' (default: "
                                        "SmolLM2-135M-Instruct, else the demo model)")
    parser.add_argument("--port", type=int,
                        help="port of the server this command starts, on 127.0.0.1 (default: "
                             "a free one)")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                        help="the server's API key (default: $RADIXSERVE_API_KEY)")
    parser.add_argument("--system", help="a system message that opens the conversation")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="longest reply in tokens (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature; 0 is greedy (default: 0.7)")


def run(args: argparse.Namespace) -> int:
    if args.url and (args.model or args.port is not None):
        print("radixserve chat: --model and --port are for the server it starts; with --url, "
              "give neither", file=sys.stderr)
        return 2
    if args.port is not None and not 0 < args.port < 65536:
        print(f"radixserve chat: --port {args.port} is not a port (1-65535)", file=sys.stderr)
        return 2
    from engine.server.chat_client import ChatError, LocalServer, chat

    server = None
    try:
        if args.url:
            url = args.url.rstrip("/").removesuffix("/v1")
        else:
            print("starting a server with " + (args.model or "the default model") + " ...",
                  file=sys.stderr, flush=True)
            server = LocalServer.start(args.model, args.port)
            url = server.url
        chat(url, api_key=args.api_key, system=args.system, max_tokens=args.max_tokens,
             temperature=args.temperature)
        return 0
    except ChatError as exc:
        print(f"radixserve chat: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
