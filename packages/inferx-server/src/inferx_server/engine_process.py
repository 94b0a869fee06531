"""The engine in a child process (`server.engine_process`): its own GIL, apart from the HTTP side.

On one GIL the engine thread's Python work per step (scheduling, launching, detokenizing) and the
event loop's per-SSE-event work compete; at 256 streams they no longer both fit in a GPU step
(docs/BENCHMARKS.md, "Transport with the real engine"). Here the child owns the Engine (and the
GPU) and runs the step loop; the server process keeps tokenizing, the HTTP API and SSE. They
talk over one duplex pipe of pickled messages:

    parent -> child: ("add", key, rids, items) | ("abort", rids, notify) | ("stop",)
    child -> parent: ("ready", tokenizer, max_model_len, name_source)
                     ("settled", key, error or None)   add accepted, or refused with error
                     ("out", outputs, time, stats)     one step's RequestOutputs
                     ("beat", stats)                   idle, alive
                     ("dead", error)                   the loop raised; the child exits

ProcessEngineLoop is EngineLoop with its thread reading the pipe instead of stepping an engine,
so requests, streaming, aborts and health behave the same either way.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from inferx_server.engine_loop import EngineLoop, Submission, abort_requests, add_requests

log = logging.getLogger("inferx.server")

_BEAT_S = 0.5


def build_engine(config: Any) -> Any:
    """The default factory: the Engine a config describes (runs in the child). On a CPU, unless
    engine.threads says otherwise, torch leaves one core to the HTTP process: its threads
    spinning on every core made a tiny model's tokens 2-3x slower."""
    import os

    import torch

    from inferx_core.engine import Engine

    cpu = config.engine.device == "cpu" or (
        config.engine.device == "auto" and not torch.cuda.is_available()
    )
    if cpu and config.engine.threads is None:
        threads = max(1, (os.cpu_count() or 2) - 1)
        engine = config.engine.model_copy(update={"threads": threads})
        config = config.model_copy(update={"engine": engine})
    return Engine(config)


def _child(conn: Connection, factory: Callable[[], Any]) -> None:
    try:
        engine = factory()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("dead", exc))
        return
    source = getattr(getattr(getattr(engine, "executor", None), "checkpoint", None), "source", "")
    conn.send(("ready", engine.tokenizer, engine.max_model_len, source))
    try:
        while True:
            if not engine.has_work() and not conn.poll(_BEAT_S):
                conn.send(("beat", engine.scheduler.stats()))
                continue
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                _command(engine, conn, msg)
            if engine.has_work():
                outputs = engine.step()
                conn.send(("out", outputs, time.monotonic(), engine.scheduler.stats()))
    except (EOFError, BrokenPipeError):  # the parent went away
        return
    except BaseException as exc:  # noqa: BLE001
        log.exception("the engine process died")
        with contextlib.suppress(OSError, ValueError):
            conn.send(("dead", exc))


def _command(engine: Any, conn: Connection, msg: tuple) -> None:
    if msg[0] == "add":
        _, key, rids, items = msg
        conn.send(("settled", key, add_requests(engine, rids, items)))
    elif msg[0] == "abort" and (outs := abort_requests(engine, *msg[1:])):
        conn.send(("out", outs, time.monotonic(), engine.scheduler.stats()))


class EngineProcess:
    """The parent's handle on the child: what the transport reads of an engine (tokenizer,
    max_model_len) and the pipe. Constructing it returns once the child has built its engine,
    or raises what building it raised."""

    def __init__(self, factory: Callable[[], Any], start_timeout: float = 600.0) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child, args=(child_conn, factory), name="inferx-engine", daemon=True
        )
        self.process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        if not self.conn.poll(start_timeout):
            self.close()
            raise RuntimeError(f"the engine process did not start in {start_timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError("the engine process exited while starting") from None
        if msg[0] == "dead":
            self.close()
            raise msg[1]
        _, self.tokenizer, self.max_model_len, self.source = msg

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def close(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)


class _PipeInbox:
    """EngineLoop's command queue, forwarded to the child by a thread of its own: a send blocks
    while the pipe is full (a burst of long prompts while the child is mid-step), and the event
    loop must not. Adds wait in `adding` for their "settled"."""

    def __init__(self, proc: EngineProcess) -> None:
        self.proc = proc
        self.adding: dict[int, Submission] = {}
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_all, name="inferx-send", daemon=True)
        self._thread.start()

    def put(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            sub: Submission = arg
            self.adding[id(sub)] = sub
            self._queue.put(("add", id(sub), sub.rids, sub.items))
        elif kind == "abort":
            rids, notify = arg
            self._queue.put(("abort", rids, notify))
        # "wake" (stop): stop() closes the process instead

    def close(self) -> None:
        self._queue.put(None)

    def _send_all(self) -> None:
        while (msg := self._queue.get()) is not None:
            try:
                self.proc.send(msg)
            except (OSError, ValueError):  # the child is gone: the reader thread reports it
                return


class ProcessEngineLoop(EngineLoop):
    """EngineLoop over an EngineProcess: its thread reads the child's messages."""

    def __init__(self, proc: EngineProcess, **kwargs: Any) -> None:
        super().__init__(proc, **kwargs)
        self.proc = proc
        self._inbox = _PipeInbox(proc)  # type: ignore[assignment]

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.close()  # type: ignore[attr-defined]
        self.proc.close(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        inbox: _PipeInbox = self._inbox  # type: ignore[assignment]
        try:
            while not self._stopping:
                msg = self.proc.conn.recv()
                self._heartbeat = time.monotonic()
                kind = msg[0]
                if kind == "out":
                    _, outputs, t, self.stats = msg
                    self.steps += 1
                    loop.call_soon_threadsafe(self._deliver, outputs, t)
                elif kind == "beat":
                    self.stats = msg[1]
                elif kind == "settled":
                    sub = inbox.adding.pop(msg[1], None)
                    if sub is not None:
                        loop.call_soon_threadsafe(self._settle, sub, msg[2])
                elif kind == "dead":
                    raise msg[1]
        except (EOFError, OSError) as exc:
            if self._stopping:
                return
            self._died(RuntimeError(f"the engine process exited ({exc!r})"))
        except BaseException as exc:  # noqa: BLE001
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        log.error("the engine process died: %r", exc)
        self._dead = exc
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all, exc)
