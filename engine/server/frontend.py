"""The frontend process of ``radixserve serve``: binds the port, starts the engine's process
group, then serves HTTP (uvicorn) and optionally ZMQ on one event loop, with the EngineClient
on that same loop.

    bind port ─▶ Launcher.start() ─▶ event loop: EngineClient + uvicorn (+ ZMQ door) ─▶ shutdown
    (fails fast     (children ready,      prints the ready line once listening)
     if taken)       ~15 s on 2 cores)

Ending: SIGINT / SIGTERM shut down gracefully (exit 0):

    signal ─▶ drain: new requests and /health get 503, ─▶ the rest get a 503 ─▶ uvicorn closes,
              running ones finish (--shutdown-timeout;      error              the launcher stops
              a second signal cuts it short)                                   the children

A child dying ends everything with exit 1: every pending request first gets a 503 error,
``/health`` turns 503, then the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn
import zmq

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import ModelInfo
from engine.runtime.client import EngineClient
from engine.runtime.launcher import EngineError, Launcher
from engine.server.app import build_app
from engine.server.dp_monitor import DispatchMonitor
from engine.server.service import Service
from engine.server.zmq_frontend import ZmqFrontend

if TYPE_CHECKING:
    from engine.server.grpc_frontend import GrpcFrontend

logger = logging.getLogger("radixserve.server")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    zmq_port: int | None = None
    grpc_port: int | None = None
    max_request_bytes: int = 8 << 20
    max_pending_requests: int = 4096
    default_max_tokens: int = 256
    shutdown_timeout: float = 30.0
    salt_from_user: bool = False
    metrics_open: bool = False


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None],
                 on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_started = on_started
        self.on_signal = on_signal

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not uvicorn's shutdown: running requests get to finish first (``_serve`` sets
        # should_exit once they have). Nor its re-raising of the signal once serving ends:
        # the launcher still has children to stop, and then exits 0.
        self.on_signal()


class _DeathRelay:
    """Hands a child's death, reported on a launcher thread, to the event loop once it runs."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._notify: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def __call__(self, reason: str) -> None:
        with self._lock:
            self.reason = reason
            notify = self._notify
        if notify is not None:
            notify(reason)

    def attach(self, loop: asyncio.AbstractEventLoop, handler: Callable[[str], None]) -> None:
        with self._lock:
            self._notify = lambda reason: loop.call_soon_threadsafe(handler, reason)
            reason = self.reason
        if reason is not None:
            handler(reason)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says TCP. With Nagle on, a stream's first token waited ~40 ms
    # in the kernel for the client's delayed ACK of the response headers.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM while starting: unwind through Launcher.start's cleanup


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Run the server until a signal (exit 0) or a child process dies (exit 1)."""
    # Both ports first: a port in use fails in a second, not after the engine has started.
    try:
        sock = _bind(options.host, options.port)
    except OSError as exc:
        print(f"radixserve serve: cannot listen on {options.host}:{options.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    zmq_door = None
    if options.zmq_port is not None:
        # Where HTTP listens (the address --host resolved to), and nowhere else.
        address = f"tcp://{_url_host(sock.getsockname()[0])}:{options.zmq_port}"
        try:
            zmq_door = ZmqFrontend(address, options.max_request_bytes, options.api_key)
        except zmq.ZMQError as exc:
            print(f"radixserve serve: cannot listen on {address}: {exc}", file=sys.stderr)
            sock.close()
            return 1
    grpc_door = None
    if options.grpc_port is not None:
        from engine.server.grpc_frontend import GrpcFrontend

        try:
            _bind(options.host, options.grpc_port).close()  # taken: fail before the engine
            # The endpoint is filled in once the launcher has chosen it.
            grpc_door = GrpcFrontend(sock.getsockname()[0], options.grpc_port, "")
        except (ImportError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            print(f"radixserve serve: --grpc-port {options.grpc_port}: {reason}",
                  file=sys.stderr)
            sock.close()
            if zmq_door is not None:
                zmq_door.close()
            return 1
    relay = _DeathRelay()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    launcher = Launcher(config, on_death=relay, publish_kv_events=grpc_door is not None)
    if grpc_door is not None:
        grpc_door.kv_events_endpoint = launcher.config.kv_events_endpoint
    try:
        info = launcher.start()
        code = None
    except EngineError as exc:
        print(f"radixserve serve: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        if code is None:
            code = asyncio.run(_serve(config, options, launcher, info, sock, zmq_door, relay,
                                      grpc_door))
        return code
    finally:
        if zmq_door is not None:
            zmq_door.close()
        launcher.shutdown()
        sock.close()


async def _serve(config: EngineConfig, options: ServeOptions, launcher: Launcher,
                 info: ModelInfo, sock: socket.socket, zmq_door: ZmqFrontend | None,
                 relay: _DeathRelay, grpc_door: GrpcFrontend | None = None) -> int:
    client = EngineClient(launcher.endpoints, info.num_pages)
    client.start()
    dispatch = None
    if config.dp_size > 1:
        dispatch = DispatchMonitor(launcher.endpoints.dispatch_stats, config.dp_size,
                                   info.num_pages)
        dispatch.start()
    service = Service(client, info, config, max_pending=options.max_pending_requests,
                      default_max_tokens=options.default_max_tokens,
                      salt_from_user=options.salt_from_user, dispatch=dispatch)
    app = build_app(service, api_key=options.api_key,
                    max_request_bytes=options.max_request_bytes,
                    metrics_open=options.metrics_open)
    if zmq_door is not None:
        zmq_door.start(service)
    if grpc_door is not None:
        try:
            await grpc_door.start(service)
        except OSError as exc:
            print(f"radixserve serve: {exc}", file=sys.stderr)
            client.close()
            return 1

    def ready() -> None:
        url = f"http://{_url_host(options.host)}:{sock.getsockname()[1]}"
        extra = f", ZMQ at {zmq_door.address}" if zmq_door is not None else ""
        if grpc_door is not None:
            extra += f", gRPC (smg's vLLM service) on port {grpc_door.port}"
        print(f"radixserve: serving {service.model_name} at {url} (OpenAI API at {url}/v1"
              f"{extra})", flush=True)

    loop = asyncio.get_running_loop()
    drain: asyncio.Task | None = None
    cut_short = asyncio.Event()
    death: list[str] = []

    async def drain_then_exit() -> None:
        service.shutting_down = True
        running = client.num_pending
        if running:
            logger.warning("shutting down: %d running requests get up to %g s to finish",
                           running, options.shutdown_timeout)
        deadline = loop.time() + options.shutdown_timeout
        while client.num_pending and loop.time() < deadline and not cut_short.is_set():
            await asyncio.sleep(0.05)
        if client.num_pending:
            logger.warning("shutting down: failing %d requests that did not finish in time",
                           client.num_pending)
            client.fail_all("the server shut down before this request finished")
        server.should_exit = True

    def signalled() -> None:
        nonlocal drain
        if drain is None:
            drain = loop.create_task(drain_then_exit())
        elif not drain.done():
            cut_short.set()
        else:
            server.force_exit = True  # a third signal: stop waiting for connections too

    level = config.log_level.lower()
    server = _Uvicorn(uvicorn.Config(app, log_level=level, access_log=level in ("debug", "info"),
                                     lifespan="off", timeout_graceful_shutdown=5), ready,
                      lambda: loop.call_soon_threadsafe(signalled))

    def died(reason: str) -> None:
        death.append(reason)
        client.fail_all(reason)  # pending requests get their error before the server stops
        server.should_exit = True

    relay.attach(loop, died)
    try:
        await server.serve(sockets=[sock])
    finally:
        if client.dead is None:
            # From here no stream may reach the engine: a stream closed late (as the loop
            # ends) must not send its abort through a closed socket.
            client.fail_all("the server stopped")
        if zmq_door is not None:
            await zmq_door.stop()
        if grpc_door is not None:
            await grpc_door.stop()
        client.close()
        if dispatch is not None:
            dispatch.close()
    if death:
        print(f"radixserve serve: {death[0]}", file=sys.stderr)
        return 1
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

