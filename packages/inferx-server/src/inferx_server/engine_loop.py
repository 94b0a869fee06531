"""Runs Engine.step() on its own thread and routes each step's outputs to the HTTP requests.

The engine is not thread-safe, so only the loop thread touches it: the event loop sends it
commands (add, abort) through a queue it drains between steps, and it hands each step's outputs
back with one call_soon_threadsafe per step. Outputs that pile up while a client is slow are
delivered together, so a busy event loop sends fewer, larger chunks instead of falling behind.
ProcessEngineLoop (at the end) is the same loop over an engine in a child process
(engine_process.py), its thread reading the child's messages instead of stepping an engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferx_core.engine import RequestOutput, add_all
from inferx_core.interfaces import SchedulerStats
from inferx_core.sequence import SamplingParams

if TYPE_CHECKING:
    from inferx_server.engine_process import EngineProcess

log = logging.getLogger("inferx.server")


class EngineDead(RuntimeError):
    """The engine loop has stopped; no request can be served."""


def add_requests(
    engine: Any, rids: list[str], items: list[tuple[list[int], SamplingParams]]
) -> Exception | None:
    """Add every item as one engine request, all or none (inferx_core.engine.add_all): the
    refusal, if one was refused, is returned rather than raised."""
    try:
        add_all(engine, items, rids)
    except Exception as exc:
        return exc
    return None


def abort_requests(engine: Any, rids: list[str], notify: bool) -> list[RequestOutput]:
    """Abort rids; with notify, the final "abort" output of each that was still running."""
    ended = [rid for rid in rids if engine.abort(rid) or notify]
    if not notify:
        return []
    return [RequestOutput(rid, [], "", True, "abort", 0, 0, 0) for rid in ended]


@dataclass(eq=False)
class Submission:
    """One HTTP request: its engine requests (prompts x n choices) and their pending outputs.

    Fields after `items` belong to the event-loop thread.
    """

    rids: list[str]
    items: list[tuple[list[int], SamplingParams]]
    accepted: asyncio.Future[None]
    arrival: float = field(default_factory=time.monotonic)
    pending: list[tuple[int, RequestOutput]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None
    aborted: bool = False  # by the server: its outputs stop without a final one
    hold: float = 0.0  # seconds an idle engine waits for more adds after this one (_gather)
    open: int = 0  # engine requests not finished yet
    first: list[float | None] = field(default_factory=list)  # first-token time per choice
    last: list[float] = field(default_factory=list)  # last-output time per choice

    def __post_init__(self) -> None:
        self.open = len(self.rids)
        self.first = [None] * len(self.rids)
        self.last = [self.arrival] * len(self.rids)


class EngineLoop:
    """Owns the engine's thread. start() from the event loop; submit()/abort() from handlers."""

    def __init__(
        self,
        engine: Any,
        health_timeout: float = 30.0,
        on_output: Callable[[Submission, int, RequestOutput, float], None] | None = None,
        on_abort: Callable[[int], None] | None = None,
        intake_wait: float = 0.0,
    ) -> None:
        self.engine = engine
        self.health_timeout = health_timeout
        # server.intake_wait_ms: how long an idle engine handed a request waits for those still
        # being tokenized (`encoding`, counted by requests._encode), so a burst shares a step.
        self.intake_wait = intake_wait
        self.encoding = 0
        self.on_output = on_output  # metrics hooks, called on the event-loop thread
        self.on_abort = on_abort
        self.stats = SchedulerStats(running=0, waiting=0, kv_usage=0.0)
        self.steps = 0
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._routes: dict[str, tuple[Submission, int]] = {}
        self._subs: set[Submission] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._heartbeat = time.monotonic()

    # -- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inferx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        """HTTP requests whose engine requests have not all finished."""
        return len(self._subs)

    def health(self) -> str | None:
        """None while the loop is alive and stepping; otherwise what is wrong."""
        if self._dead is not None:
            return f"the engine loop died: {self._dead!r}"
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        stalled = time.monotonic() - self._heartbeat
        if stalled > self.health_timeout:
            return f"the engine loop has not finished a step for {stalled:.0f} s"
        return None

    async def submit(
        self, items: list[tuple[list[int], SamplingParams]], request_id: str
    ) -> Submission:
        """Queue every item as one engine request; all are accepted or none.

        Raises what Engine.add_request raises (ValueError, QueueFullError), or EngineDead.
        Acceptance happens between two steps, when the requests could first run anyway.
        """
        if self._dead is not None or self._stopping:
            raise EngineDead(self.health() or "the engine loop is stopping")
        assert self._loop is not None, "EngineLoop.start() was not called"
        rids = [f"{request_id}-{i}" for i in range(len(items))]
        sub = Submission(rids, items, self._loop.create_future())
        sub.hold = self.intake_wait if self.encoding else 0.0
        for i, rid in enumerate(rids):
            self._routes[rid] = (sub, i)
        self._subs.add(sub)
        self._inbox.put(("add", sub))
        try:
            await sub.accepted
        except BaseException:
            self.abort(sub)
            raise
        return sub

    async def outputs(self, sub: Submission) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Everything the engine produced for `sub` since the last batch, until all finish."""
        while True:
            await sub.wake.wait()
            sub.wake.clear()
            if sub.pending:
                batch, sub.pending = sub.pending, []
                yield batch
            if sub.error is not None:
                raise EngineDead(str(sub.error)) from sub.error
            if sub.open == 0 or sub.aborted:
                return

    def abort(self, sub: Submission, notify: bool = False) -> None:
        """Stop whatever of `sub` still runs. With notify, its outputs end with "abort"."""
        if sub not in self._subs:
            return
        self._subs.discard(sub)
        live = [rid for rid in sub.rids if rid in self._routes]
        if not notify:  # nothing more will arrive: let a waiting consumer go
            for rid in live:
                del self._routes[rid]
            sub.aborted = True
            sub.wake.set()
        if live:
            if self.on_abort is not None:
                self.on_abort(len(live))
            self._inbox.put(("abort", (live, notify)))

    def abort_all(self) -> None:
        """End every request now (drain timeout): the server answers each with an error
        (responses._CUT), as no finish_reason of OpenAI's says "cut short by the server"."""
        for sub in list(self._subs):
            self.abort(sub, notify=True)

    def _deliver(self, outputs: list[RequestOutput], t: float) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # aborted by its client
            sub, index = route
            sub.pending.append((index, out))
            sub.wake.set()
            if self.on_output is not None:
                self.on_output(sub, index, out, t)
            if out.finished:
                del self._routes[out.request_id]
                sub.open -= 1
                if sub.open == 0:
                    self._subs.discard(sub)

    def _settle(self, sub: Submission, error: BaseException | None) -> None:
        if sub.accepted.done():
            return
        if error is None:
            sub.accepted.set_result(None)
        else:
            for rid in sub.rids:
                self._routes.pop(rid, None)
            self._subs.discard(sub)
            sub.accepted.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        for sub in list(self._subs):
            self._settle(sub, EngineDead(str(error)))
            sub.error = error
            sub.wake.set()
        self._subs.clear()
        self._routes.clear()

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        check = getattr(engine, "check", None)  # Engine.check: a dead device side, while idle
        try:
            while not self._stopping:
                idle = not engine.has_work()
                # An idle loop still wakes twice a second, so that its heartbeat stays fresh.
                hold = self._take_commands(0.5 if idle else 0.0)
                if idle and hold:
                    self._gather(hold)
                if engine.has_work():
                    outputs = engine.step()
                    self.steps += 1
                    if outputs:
                        loop.call_soon_threadsafe(self._deliver, outputs, time.monotonic())
                elif check is not None:
                    check()
                self.stats = engine.scheduler.stats()
                self._heartbeat = time.monotonic()
        except BaseException as exc:
            log.exception("the engine loop died")
            self._dead = exc
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._fail_all, exc)

    def _take_commands(self, wait: float) -> float | None:
        """Runs every queued command, waiting up to `wait` seconds for the first. Returns the
        hold of the last add among them (0.0 when none was an add), None when none came."""
        try:
            cmd = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        hold = 0.0
        while True:
            if cmd[0] == "add":
                hold = cmd[1].hold
            self._command(*cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return hold

    def _gather(self, hold: float) -> None:
        """The idle engine was handed a request while others were still being tokenized: take
        commands for up to `hold` seconds more, until an add comes with none behind it, so that
        a burst's prompts share one prompt step instead of the first one running alone."""
        deadline = time.monotonic() + hold
        while (left := deadline - time.monotonic()) > 0:
            if not self._take_commands(left):
                return

    def _command(self, kind: str, arg: Any) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        if kind == "add":
            sub: Submission = arg
            refused = add_requests(engine, sub.rids, sub.items)
            loop.call_soon_threadsafe(self._settle, sub, refused)
        elif kind == "abort" and (outs := abort_requests(engine, *arg)):
            loop.call_soon_threadsafe(self._deliver, outs, time.monotonic())


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
            self._queue.put(("add", id(sub), sub.rids, sub.items, sub.arrival, sub.hold))
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
