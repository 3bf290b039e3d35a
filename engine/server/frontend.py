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
from typing import TYPE_CHECKING

import uvicorn
import zmq

try:  # the faster event loop and HTTP parser where installed (pyproject lists both)
    import uvloop
except ImportError:
    uvloop = None
try:
    import httptools  # noqa: F401  (only whether it imports)
    HTTP_PARSER = "httptools"
except ImportError:
    HTTP_PARSER = "h11"

from engine.contracts.engine_config import EngineConfig
from engine.contracts.worker_messages import ModelInfo
from engine.runtime.client import EngineClient
from engine.runtime.launcher import Launcher, LaunchError
from engine.server.app import build_app
from engine.server.dp_monitor import DispatchMonitor
from engine.server.net import bind_tcp, host_port
from engine.server.options import ServeOptions
from engine.server.service import Service
from engine.server.zmq_frontend import ZmqFrontend

if TYPE_CHECKING:
    from engine.server.grpc_frontend import GrpcFrontend

logger = logging.getLogger("radixserve.server")


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


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM while starting: unwind through Launcher.start's cleanup


class _Doors:
    """The server's listening doors, bound before the engine starts (a port in use fails in a
    second, not after minutes of loading): HTTP's socket, and the ZMQ and gRPC doors asked
    for."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        try:
            self.http = bind_tcp(options.host, options.port)
        except OSError as exc:
            raise OSError(f"cannot listen on {host_port(options.host, options.port)}: "
                          f"{exc.strerror or exc}") from None
        self.zmq: ZmqFrontend | None = None
        self.grpc: GrpcFrontend | None = None
        try:
            if options.zmq_port is not None:
                # Where HTTP listens (the address --host resolved to), and nowhere else.
                address = f"tcp://{host_port(self.http.getsockname()[0], options.zmq_port)}"
                try:
                    self.zmq = ZmqFrontend(address, options.max_request_bytes)
                except zmq.ZMQError as exc:
                    raise OSError(f"cannot listen on {address}: {exc}") from None
            if options.grpc_port is not None:
                from engine.server.grpc_frontend import GrpcFrontend

                try:
                    bind_tcp(options.host, options.grpc_port).close()  # taken: fail now
                    # The KV events endpoint is filled in once the launcher has chosen it.
                    self.grpc = GrpcFrontend(self.http.getsockname()[0], options.grpc_port, "")
                except (ImportError, OSError) as exc:
                    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    raise OSError(f"--grpc-port {options.grpc_port}: {reason}") from None
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self.zmq is not None:
            self.zmq.close()
        self.http.close()

    def ready_line(self, model_name: str) -> str:
        url = f"http://{host_port(self.options.host, self.http.getsockname()[1])}"
        extra = f", ZMQ at {self.zmq.address}" if self.zmq is not None else ""
        if self.grpc is not None:
            extra += f", gRPC (smg's vLLM service) on port {self.grpc.port}"
        return f"radixserve: serving {model_name} at {url} (OpenAI API at {url}/v1{extra})"


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Run the server until a signal (exit 0) or a child process dies (exit 1)."""
    try:
        doors = _Doors(options)
    except OSError as exc:
        print(f"radixserve serve: {exc}", file=sys.stderr)
        return 1
    relay = _DeathRelay()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    launcher = Launcher(config, on_death=relay, publish_kv_events=doors.grpc is not None)
    if doors.grpc is not None:
        doors.grpc.kv_events_endpoint = launcher.config.kv_events_endpoint
    try:
        info = launcher.start()
        code = None
    except LaunchError as exc:
        print(f"radixserve serve: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        if code is None:
            run = asyncio.run if uvloop is None else uvloop.run
            code = run(_serve(config, options, launcher, info, doors, relay))
        return code
    finally:
        launcher.shutdown()
        doors.close()


class _Drain:
    """SIGTERM / SIGINT: new requests and /health get 503 at once, running ones get
    ``--shutdown-timeout`` seconds, then the rest are failed and uvicorn stops. A second signal
    cuts the wait short; a third stops waiting for connections too."""

    def __init__(self, service: Service, timeout: float) -> None:
        self.service = service
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.server: _Uvicorn | None = None
        self.task: asyncio.Task | None = None
        self.cut_short = asyncio.Event()

    def signalled(self) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._drain_then_exit())
        elif not self.task.done():
            self.cut_short.set()
        else:
            self.server.force_exit = True

    async def _drain_then_exit(self) -> None:
        client = self.service.client
        self.service.shutting_down = True
        if client.num_pending:
            logger.warning("shutting down: %d running requests get up to %g s to finish",
                           client.num_pending, self.timeout)
        deadline = self.loop.time() + self.timeout
        while client.num_pending and self.loop.time() < deadline and not self.cut_short.is_set():
            await asyncio.sleep(0.05)
        if client.num_pending:
            logger.warning("shutting down: failing %d requests that did not finish in time",
                           client.num_pending)
            client.fail_all("the server shut down before this request finished")
        self.server.should_exit = True


async def _serve(config: EngineConfig, options: ServeOptions, launcher: Launcher,
                 info: ModelInfo, doors: _Doors, relay: _DeathRelay) -> int:
    client = EngineClient(launcher.endpoints, info.num_pages)
    client.start()
    dispatch = None
    if config.dp_size > 1:
        dispatch = DispatchMonitor(launcher.endpoints.dispatch_stats, config.dp_size,
                                   info.num_pages)
        dispatch.start()
    service = Service(client, info, config, options, dispatch=dispatch)
    app = build_app(service)
    if doors.zmq is not None:
        doors.zmq.start(service)
    if doors.grpc is not None:
        try:
            await doors.grpc.start(service)
        except OSError as exc:
            print(f"radixserve serve: {exc}", file=sys.stderr)
            client.close()
            return 1
    loop = asyncio.get_running_loop()
    drain = _Drain(service, options.shutdown_timeout)
    level = config.log_level.lower()
    server = _Uvicorn(uvicorn.Config(app, log_level=level, access_log=level in ("debug", "info"),
                                     lifespan="off", timeout_graceful_shutdown=5,
                                     http=HTTP_PARSER),
                      lambda: print(doors.ready_line(service.model_name), flush=True),
                      lambda: loop.call_soon_threadsafe(drain.signalled))
    drain.server = server
    death: list[str] = []

    def died(reason: str) -> None:
        death.append(reason)
        client.fail_all(reason)  # pending requests get their error before the server stops
        server.should_exit = True

    relay.attach(loop, died)
    try:
        await server.serve(sockets=[doors.http])
    finally:
        if client.dead is None:
            # From here no stream may reach the engine: a stream closed late (as the loop
            # ends) must not send its abort through a closed socket.
            client.fail_all("the server stopped")
        if doors.zmq is not None:
            await doors.zmq.stop()
        if doors.grpc is not None:
            await doors.grpc.stop()
        client.close()
        if dispatch is not None:
            dispatch.close()
    if death:
        print(f"radixserve serve: {death[0]}", file=sys.stderr)
        return 1
    return 0
