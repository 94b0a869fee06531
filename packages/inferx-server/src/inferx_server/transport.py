"""The litestar Transport: serves an Engine over uvicorn on one socket and drains on SIGTERM."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from inferx_core.chat_formats import harmony_format
from inferx_core.hub import is_hub_id
from inferx_core.interfaces import Transport
from inferx_core.parallel import RankFailure
from inferx_server.app import ServerState, create_app
from inferx_server.engine_loop import EngineLoop, ProcessEngineLoop
from inferx_server.engine_process import EngineProcess, checkpoint_source
from inferx_server.listen import bind
from inferx_server.metrics import Metrics

log = logging.getLogger("inferx.server")


def served_model_name(config: Any, engine: Any) -> str:
    """model.served_name, else the checkpoint's file or directory name (without .gguf)."""
    if config.model.served_name:
        return config.model.served_name
    if config.model.path and is_hub_id(config.model.path):
        return config.model.path  # org/name, as the hub and vLLM name it
    source = checkpoint_source(engine) or getattr(engine, "source", "")  # an EngineProcess's
    source = source or config.model.path or config.model.preset or "model"
    name = Path(source.removeprefix("dummy:").rstrip("/")).name
    return name.removesuffix(".gguf") or "model"


class LitestarTransport(Transport):
    """engine: an inferx_core.engine.Engine, stepped on the EngineLoop's thread, or an
    EngineProcess (server.engine_process), stepped in its own process; config: Config."""

    def __init__(self, engine: Any, config: Any) -> None:
        self.config = config
        name = served_model_name(config, engine)
        loop_cls = ProcessEngineLoop if isinstance(engine, EngineProcess) else EngineLoop
        loop = loop_cls(
            engine,
            health_timeout=config.server.health_timeout,
            intake_wait=config.server.intake_wait_ms / 1e3,
        )
        metrics = Metrics(name, lambda: loop.stats)
        loop.on_output, loop.on_abort = metrics.on_output, metrics.on_abort
        aliases = frozenset(a for a in (config.model.path, config.model.preset) if a)
        self.state = ServerState(
            loop=loop,
            tokenizer=engine.tokenizer,
            model_name=name,
            max_model_len=engine.max_model_len,
            metrics=metrics,
            aliases=aliases,
            api_key=config.server.api_key,
            max_waiting=config.scheduler.max_waiting,
            chat_format=harmony_format(engine.tokenizer),
            tool_call_grammar=config.server.tool_call_grammar,
        )
        self.app = create_app(self.state)
        self.server: _DrainingServer | None = None
        self.failure: BaseException | None = None  # why serve() stopped, where not asked to

    def serve(
        self, sock: socket.socket | None = None, on_ready: Callable[[str], Any] | None = None
    ) -> None:
        """Serve until stop(), or SIGTERM/SIGINT (which drain first). on_ready gets the URL."""
        if sock is None:
            sock = bind(self.config.server.host, self.config.server.port)
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        uv = uvicorn.Config(
            self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
        self.server = _DrainingServer(uv, self, lambda: on_ready(url) if on_ready else None)
        self.server.run(sockets=[sock])

    def drain(self) -> None:
        """Refuse new requests (503); stop once in-flight ones end or drain_timeout passes."""
        if self.server is not None:
            self.server.begin_drain()

    def stop(self) -> None:
        """Stop now, from any thread; streams still open are cut."""
        if self.server is not None:
            self.server.should_exit = True


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT drains instead of closing."""

    def __init__(
        self, config: uvicorn.Config, transport: LitestarTransport, on_ready: Callable[[], Any]
    ) -> None:
        super().__init__(config)
        self.transport = transport
        self.on_ready = on_ready
        self.deadline: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready()

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Deliberately not recorded in _captured_signals: uvicorn would re-raise the signal once
        # stopped, and a drained server exits 0.
        if self.deadline is None:
            self.begin_drain()
        else:  # a second signal: stop waiting
            self.deadline = 0.0

    def begin_drain(self) -> None:
        if self.deadline is not None:
            return
        state = self.transport.state
        timeout = self.transport.config.server.drain_timeout
        self.deadline = time.monotonic() + timeout
        state.draining = True
        log.warning(
            "draining: %d requests in flight, waiting up to %.0f s", state.loop.in_flight, timeout
        )

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s.
        loop = self.transport.state.loop
        dead = getattr(loop, "_dead", None)
        if isinstance(dead, RankFailure) and not self.should_exit:
            # a tensor-parallel rank is gone: this engine cannot step again, so the server ends
            log.error("exiting: %s", dead)
            self.transport.failure = dead
            self.should_exit = True
        if self.deadline is not None and not self.should_exit:
            if loop.in_flight and time.monotonic() >= self.deadline:
                log.warning("drain timeout: aborting %d requests", loop.in_flight)
                loop.abort_all()
            if not loop.in_flight:
                self.should_exit = True
        return await super().on_tick(counter)
