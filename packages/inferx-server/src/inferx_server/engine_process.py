"""The engine in a child process (`server.engine_process`): its own GIL, apart from the HTTP side.

On one GIL the engine thread's Python work per step (scheduling, launching, detokenizing) and the
event loop's per-SSE-event work compete; at 256 streams they no longer both fit in a GPU step
(docs/BENCHMARKS.md, "Transport with the real engine"). Here the child owns the Engine (and the
GPU) and runs the step loop; the server process keeps tokenizing, the HTTP API and SSE. They
talk over one duplex pipe of pickled messages:

    parent -> child: ("add", key, rids, items, handed, hold) | ("abort", rids, notify) | ("stop",)
    child -> parent: ("ready", tokenizer, max_model_len, name_source)
                     ("settled", key, error or None)   add accepted, or refused with error
                     ("out", outputs, time, stats)     one step's RequestOutputs
                     ("beat", stats)                   idle, alive
                     ("dead", error)                   the loop raised; the child exits

ProcessEngineLoop (engine_loop.py) is EngineLoop with its thread reading the pipe instead of
stepping an engine, so requests, streaming, aborts and health behave the same either way. This
module imports nothing heavy (no torch): inferx-server spawns the child before its own imports,
which then overlap the child's start-up.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("inferx.server")

_BEAT_S = 0.5


def build_engine(config: Any) -> Any:
    """The default factory: the Engine a config describes (runs in the child). On a CPU, unless
    engine.threads says otherwise, torch leaves one core to the HTTP process: its threads
    spinning on every core made a tiny model's tokens 2-3x slower."""
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


def preload_grammars(engine: Any) -> None:
    """A serving engine builds its grammar backend at once, on a thread (Grammars.preload):
    structured requests need not wait for it. Engines without grammars (stubs) have nothing."""
    preload = getattr(getattr(engine, "grammars", None), "preload", None)
    if preload is not None:
        preload()


def checkpoint_source(engine: Any) -> str:
    """Where an Engine's weights came from ("" when its executor does not say): the served
    model's name is made from it. An EngineProcess carries its child's as `source`."""
    checkpoint = getattr(getattr(engine, "executor", None), "checkpoint", None)
    return getattr(checkpoint, "source", "")


def show_startup_progress() -> None:
    """On a terminal, a line per start-up phase as it ends (weights, KV cache, compiles,
    graphs: the executor's "inferx.startup" logger)."""
    if sys.stderr.isatty():
        logging.getLogger("inferx.startup").setLevel(logging.INFO)


class _LockedConn:
    """The child's end of the pipe, each send under a lock: a tensor-parallel executor's
    watchdog sends "dead" from its own thread (TensorParallelExecutor.on_fatal)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        with self._lock:
            self.conn.send(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def _child(pipe: Connection, factory: Callable[[], Any]) -> None:
    logging.basicConfig(level=logging.WARNING, format="inferx-server: %(message)s")
    show_startup_progress()
    conn: Any = _LockedConn(pipe)
    try:
        engine = factory()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("dead", exc))
        return
    preload_grammars(engine)
    executor = getattr(engine, "executor", None)
    if hasattr(executor, "on_fatal"):  # a tensor-parallel rank 0: its watchdog's last word
        executor.on_fatal = lambda exc: conn.send(("dead", exc))
    conn.send(("ready", engine.tokenizer, engine.max_model_len, checkpoint_source(engine)))
    trace = StepTrace.from_env()
    check = getattr(engine, "check", None)  # Engine.check: a dead device side, while idle
    try:
        while True:
            idle = not engine.has_work()
            if idle and not conn.poll(_BEAT_S):
                if check is not None:
                    check()  # a tensor-parallel rank gone: "dead" below
                conn.send(("beat", engine.scheduler.stats()))
                continue
            hold = _take(engine, conn, trace)
            if idle and hold:  # more of a burst is being tokenized: see EngineLoop._gather
                deadline = time.monotonic() + hold
                while hold and (left := deadline - time.monotonic()) > 0 and conn.poll(left):
                    hold = _take(engine, conn, trace)
            if hold is None:
                return
            if engine.has_work():
                start = time.monotonic()
                outputs = engine.step()
                stats = engine.scheduler.stats()
                conn.send(("out", outputs, time.monotonic(), stats))
                if trace:
                    trace.step(start, len(outputs), stats)
    except (EOFError, BrokenPipeError):  # the parent went away
        return
    except BaseException as exc:  # noqa: BLE001
        log.exception("the engine process died")
        with contextlib.suppress(OSError, ValueError):
            conn.send(("dead", exc))


class StepTrace:
    """INFERX_STEP_TRACE=FILE: one line per add, per engine step and per garbage collection,
    written by the child, for reading how a burst of requests meets the steps (benchmarks, not
    production). Times are time.monotonic() seconds, one clock for both processes:
        <taken> add <requests> <ms since the server handed it to its engine loop>
        <start> step <ms> <outputs> <running> <waiting>
        <start> gc <generation> <ms> <objects collected>"""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 - lives with the child
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("INFERX_STEP_TRACE")
        return cls(path) if path else None

    def add(self, requests: int, handed: float) -> None:
        now = time.monotonic()
        self.file.write(f"{now:.6f} add {requests} {(now - handed) * 1e3:.3f}\n")

    def step(self, start: float, outputs: int, stats: Any) -> None:
        ms = (time.monotonic() - start) * 1e3
        self.file.write(f"{start:.6f} step {ms:.3f} {outputs} {stats.running} {stats.waiting}\n")
        if outputs == 0 or stats.running == 0:
            self.file.flush()

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
            return
        ms = (time.monotonic() - self._gc_start) * 1e3
        self.file.write(
            f"{self._gc_start:.6f} gc {info['generation']} {ms:.3f} {info['collected']}\n"
        )


def _take(engine: Any, conn: Connection, trace: StepTrace | None) -> float | None:
    """Runs every message waiting on the pipe. Returns the hold of the last add among them
    (0.0 when none was an add), None on "stop"."""
    hold = 0.0
    while conn.poll():
        msg = conn.recv()
        if msg[0] == "stop":
            return None
        _command(engine, conn, msg)
        if msg[0] == "add":
            hold = msg[5]
            if trace:
                trace.add(len(msg[2]), msg[4])
    return hold


def _command(engine: Any, conn: Connection, msg: tuple) -> None:
    from inferx_server.engine_loop import abort_requests, add_requests

    if msg[0] == "add":
        _, key, rids, items, _handed, _hold = msg
        conn.send(("settled", key, add_requests(engine, rids, items)))
    elif msg[0] == "abort" and (outs := abort_requests(engine, *msg[1:])):
        conn.send(("out", outs, time.monotonic(), engine.scheduler.stats()))


class EngineProcess:
    """The parent's handle on the child: what the transport reads of an engine (tokenizer,
    max_model_len) and the pipe. Constructing it returns once the child has built its engine,
    or raises what building it raised; with wait=False it returns at once, and wait_ready()
    does the waiting."""

    def __init__(
        self, factory: Callable[[], Any], start_timeout: float = 600.0, wait: bool = True
    ) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child, args=(child_conn, factory), name="inferx-engine", daemon=True
        )
        self.process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self.start_timeout = start_timeout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        if not self.conn.poll(self.start_timeout):
            self.close()
            raise RuntimeError(f"the engine process did not start in {self.start_timeout:.0f} s")
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
