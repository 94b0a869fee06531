"""Tensor parallelism over processes: one process a rank, joined by torch.distributed (NCCL on
GPUs, gloo on the CPU). parallel.distributed_executor runs a world of one rank the same way.

Rank 0 is the calling process (LLM, `inferx generate`, the server's engine): it runs the
scheduler, and its executor is a TensorParallelExecutor, which sends each step's plan to the
other ranks before running the model itself and sampling. Ranks 1..N-1 run worker_loop: the
same executor with their ParallelContext, fed the plans, sampling nothing.

On one machine rank 0 starts the others itself (`python -m inferx_core.distributed`, one
subprocess each: a subprocess, not multiprocessing, so a daemonic engine process can start
them too). Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) nothing is started: the process
of rank 0 runs the engine and every other rank's make_executor call runs the worker loop and
exits the process.

Faults: every rank runs a Heartbeat (a thread in an all-reduce of one flag on a gloo group of its
own, once a second), so a rank that dies or stops answering is seen by the others whoever
started it; rank 0's watchdog makes a step in flight that a lost rank leaves blocked (an NCCL
collective waits on the GPU) end the process with exit code 1 after STEP_GRACE_S.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from inferx_core.config import Config, ConfigError
from inferx_core.executor import LoadError, ModelRunner, pick_executor, resolve_device
from inferx_core.interfaces import (
    DoneStep,
    Executor,
    PendingStep,
    ScheduledChunk,
    SchedulerOutput,
    StepResult,
)
from inferx_core.parallel import ParallelContext, RankFailure
from inferx_core.plugins import Plugins, plugins

__all__ = ["RankFailure", "TensorParallelExecutor", "make_tensor_parallel_executor"]

log = logging.getLogger("inferx.distributed")

# The model's collectives (and start-up's) give up after this: a rank that hangs mid-step is
# an error on the others, not a hang.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# The plan broadcast waits while the engine is idle, for as long as the engine lives.
CONTROL_TIMEOUT = timedelta(days=365)
# Each rank's heartbeat thread meets the others this often; a round that waits longer than
# HEARTBEAT_TIMEOUT (a rank that vanished without closing its sockets) counts as a rank lost.
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# Once a rank is lost, how long a step in flight on rank 0 may take to fail by itself (gloo's
# collectives fail at once) before the watchdog ends the process.
STEP_GRACE_S = 5.0
FATAL_EXIT = 1  # rank 0's exit code when the watchdog ends it
STOP = -1  # a plan length that tells the workers to exit
PLAN_BYTES = 16384  # the first broadcast of each step: the plan's size, then the plan


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun (or the same environment) launched this
    process, else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))


def tensor_parallel_size(config: Config) -> int:
    """How many ranks the model is sharded over: parallel.tensor, which under torchrun must
    be torchrun's world size."""
    launched = torchrun_env()
    n = config.parallel.tensor
    if n > 1 and config.engine.device.startswith("cuda:"):
        raise ConfigError(
            f"engine.device = {config.engine.device!r} names one GPU; with parallel.tensor = {n} "
            "rank r runs on GPU r: say 'cuda' and pick the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if launched is not None and launched[1] > 1 and n != launched[1]:
        raise ConfigError(
            f"parallel.tensor = {n}, but torchrun started {launched[1]} ranks (WORLD_SIZE); "
            "give --parallel-tensor the same number"
        )
    return n


# -- the plan ------------------------------------------------------------------------------------


@dataclass
class _Window:
    """A sequence's token ids from `start` on: what a plan carries instead of the whole list."""

    start: int
    ids: list[int]

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return self.ids[key.start - self.start : key.stop - self.start]
        return self.ids[key - self.start]


class _PlannedSeq:
    """The part of a Sequence that the executor reads to run a chunk (not to sample)."""

    grammar = None  # structured output is rank 0's

    def __init__(self, start: int, ids: list[int], tables: list[list[int]]) -> None:
        self.token_ids = _Window(start, ids)
        self.block_tables = tables

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]


Plan = list[tuple[int, int, int, bool, list[int], bool, list[list[int]]]]


class PlanEncoder:
    """Rank 0's side of the plans. Per chunk: a key for its sequence, its start, token count,
    whether it samples (the head's all-gather runs for those rows), its input ids, and its
    block tables as what changed since the previous plan: when that plan held the sequence and
    each of its tables still begins with what was sent then, only the tables' new entries go
    (a decode step appends a block every block_size tokens, so most steps send none);
    otherwise the whole tables. Both sides remember exactly the previous plan's sequences, so
    a sequence that skips a step is sent whole when it returns. A key is only a name both
    sides agree on: whatever it names, the receiver's tables are the sender's."""

    def __init__(self) -> None:
        self._sent: dict[int, list[list[int]]] = {}

    def encode(self, out: SchedulerOutput) -> Plan:
        plan: Plan = []
        sent: dict[int, list[list[int]]] = {}
        for c in out.chunks:
            key = id(c.seq)
            tables = c.seq.block_tables
            old = sent.get(key, self._sent.get(key))
            unchanged = old is not None and old == tables  # most decode steps
            if unchanged:
                full, part = False, [[] for _ in tables]
            elif (
                old is not None
                and len(old) == len(tables)
                and all(t[: len(o)] == o for o, t in zip(old, tables, strict=True))
            ):
                full, part = False, [t[len(o) :] for o, t in zip(old, tables, strict=True)]
            else:
                full, part = True, tables
            sent[key] = old if unchanged else [list(t) for t in tables]  # type: ignore[assignment]
            ids = c.seq.token_ids[c.start : c.start + c.num_tokens]
            plan.append((key, c.start, c.num_tokens, c.sample, ids, full, part))
        self._sent = sent
        return plan


class PlanDecoder:
    """The other ranks' side: each plan back into the step PlanEncoder encoded. A sequence in
    consecutive plans is the same _PlannedSeq object, as it is the same Sequence on rank 0:
    the runner finds a PENDING input's token by the sequence's identity (_fill_pending)."""

    def __init__(self) -> None:
        self._tables: dict[int, list[list[int]]] = {}
        self._seqs: dict[int, _PlannedSeq] = {}

    def decode(self, plan: Plan) -> SchedulerOutput:
        chunks = []
        tables_now: dict[int, list[list[int]]] = {}
        seqs_now: dict[int, _PlannedSeq] = {}
        for key, start, n, sample, ids, full, part in plan:
            if full:
                tables = [list(t) for t in part]
            else:
                old = tables_now.get(key, self._tables.get(key))
                if old is None:
                    raise RuntimeError("a plan extends block tables this rank never received")
                tables = [o + d for o, d in zip(old, part, strict=True)]
            tables_now[key] = tables
            seq = self._seqs.get(key) if key not in seqs_now else None
            if seq is None:
                seq = _PlannedSeq(start, ids, tables)
            else:
                seq.token_ids, seq.block_tables = _Window(start, ids), tables
            seqs_now[key] = seq
            chunks.append(ScheduledChunk(seq, start, n, sample))  # type: ignore[arg-type]
        self._tables, self._seqs = tables_now, seqs_now
        return SchedulerOutput(chunks=chunks)


def send_plan(plan: Any, group: Any) -> int:
    """Broadcast a plan from rank 0 over the (CPU) control group; returns its pickled size. One
    broadcast of PLAN_BYTES carries the size and a plan that fits (a decode step of a few dozen
    sequences); a larger plan's rest follows in a second."""
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    _send(data, len(data), group)
    return len(data)


def send_stop(group: Any) -> None:
    _send(b"", STOP, group)


def _send(data: bytes, size: int, group: Any) -> None:
    head = torch.zeros(PLAN_BYTES, dtype=torch.uint8)
    head[:8].view(torch.long)[0] = size
    first = data[: PLAN_BYTES - 8]
    if first:
        head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    dist.broadcast(head, 0, group=group)
    if len(data) > len(first):
        rest = torch.frombuffer(bytearray(data[len(first) :]), dtype=torch.uint8)
        dist.broadcast(rest, 0, group=group)


def receive_plan(group: Any) -> Any:
    """The next plan from rank 0, or None when rank 0 said stop."""
    head = torch.empty(PLAN_BYTES, dtype=torch.uint8)
    dist.broadcast(head, 0, group=group)
    size = int(head[:8].view(torch.long)[0])
    if size == STOP:
        return None
    data = head[8 : 8 + size].numpy().tobytes()
    if size > PLAN_BYTES - 8:
        rest = torch.empty(size - len(data), dtype=torch.uint8)
        dist.broadcast(rest, 0, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


def run_if_worker(config: Config) -> int | None:
    """Under torchrun, on a rank above 0: run the worker loop and return its exit code (a
    server calls this before it binds its port or starts its engine process). None on rank 0
    and outside torchrun."""
    launched = torchrun_env()
    if launched is None or launched[1] == 1 or launched[0] == 0:
        return None
    rank, _, local_rank = launched
    return worker_loop(config, rank, tensor_parallel_size(config), local_rank, "env://")


# -- joining the ranks ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_type(config: Config) -> str:
    name = config.engine.device
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def join(
    config: Config, rank: int, world: int, local_rank: int, init: str
) -> tuple[ParallelContext, Any]:
    """Join the process group (init: a tcp:// address or env://); return this rank's
    ParallelContext, its model group NCCL on GPUs and gloo on the CPU, and (above world size
    1, else None) a gloo group of the same ranks for the Heartbeat."""
    device = _device_type(config)
    if device == "cuda":
        name = config.engine.device  # "cuda:N" only at world size 1 (tensor_parallel_size)
        torch.cuda.set_device(int(name.split(":")[1]) if ":" in name else local_rank)
    elif not config.engine.threads:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if device == "cuda" else "gloo"
    global _joined
    _joined = True
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    beat = dist.new_group(backend="gloo", timeout=HEARTBEAT_TIMEOUT) if world > 1 else None
    return ParallelContext(rank, world, dist.group.WORLD, cpu_group=control), beat


_joined = False  # whether this process ever joined a group (join)


def exit_if_joined(code: int) -> int:
    """Return code, unless this process joined a process group: then run Python's exit
    handlers, flush the streams and end the process with code at once (os._exit). A normal
    interpreter exit runs C++ static destructors while gloo's threads may still be alive, and
    a joinable thread destroyed there aborts the process (std::terminate) now and then."""
    if not _joined:
        return code
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def leave() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer gone already: nothing left to tear down
            dist.destroy_process_group()


class Heartbeat:
    """A thread on every rank of a world above one: each HEARTBEAT_S it joins an all-reduce
    (MAX) of one flag on the heartbeat group. A rank that dies closes its sockets and fails the
    round at once on every other rank; one that vanishes with its host fails it after
    HEARTBEAT_TIMEOUT; either way `on_lost(error)` runs on this thread. The round is independent
    of the step: a rank blocked in an NCCL collective still answers. Rank 0 ends the heartbeat
    for all (`stop()`: its next round carries the flag) before it tells the ranks to exit, so a
    clean shutdown is not a loss. Start it once every rank is built (a barrier): start-up
    times differ by more than the timeout."""

    def __init__(self, group: Any, rank: int, on_lost: Callable[[BaseException], None]) -> None:
        self.group = group
        self.rank = rank
        self.on_lost = on_lost
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferx-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        flag = torch.zeros(1, dtype=torch.int32)
        try:
            while True:
                if self.rank == 0:
                    self._stopping.wait(HEARTBEAT_S)  # stop() goes out at once
                else:
                    time.sleep(HEARTBEAT_S)
                flag.fill_(1 if self._stopping.is_set() else 0)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
                if int(flag.item()):
                    return
        except Exception as exc:  # noqa: BLE001 - any failure of a round is a lost rank
            if not self._stopping.is_set():
                self.on_lost(exc)

    def stop(self, wait: float = 0.0) -> None:
        """Rank 0: end every rank's heartbeat (the next round carries the flag); wait up to
        `wait` seconds for that round. Other ranks: stop reporting losses."""
        self._stopping.set()
        if wait:
            self._thread.join(wait)


# -- rank 0 --------------------------------------------------------------------------------------


class TensorParallelExecutor(Executor):
    """Rank 0's executor: before each step it checks that the other ranks live and sends them
    the step's plan; then its own executor runs the step and samples. Everything else
    (tokenizer, cache size, kv groups, ...) is the inner executor's.

    A rank lost (a worker it started exited, or the heartbeat failed) is a RankFailure from the
    next call, and from `check()`, which the serving loops call while idle. A step in flight
    when a rank is lost either fails by itself (gloo) or may block until the collective
    timeout (NCCL): the watchdog thread gives it STEP_GRACE_S, then calls `on_fatal` (the
    server's engine process tells its parent) and ends the process with exit code 1.

    Overlap: a step the engine submits ahead (`submit`) tells the ranks so in its plan, and
    its sampled token ids go to every rank inside the step (SampledTokens), where the next
    step's PENDING inputs are taken from, as on one rank."""

    supports_overlap = True

    def __init__(
        self,
        inner: Executor,
        parallel: ParallelContext,
        workers: list[Any],
        beat_group: Any = None,
    ) -> None:
        self.inner = inner
        self.parallel = parallel
        self.workers = workers  # subprocesses of the ranks above 0; empty under torchrun
        self.num_kv_blocks = inner.num_kv_blocks
        self.block_size = inner.block_size
        self.plan_bytes = 0  # the last plan's pickled size
        # Called on the watchdog's thread just before it ends the process.
        self.on_fatal: Callable[[RankFailure], None] | None = None
        self._plans = PlanEncoder()
        self._closed = False
        self._failed = False  # a step raised: the ranks cannot be trusted to be in step
        self._reported = False  # a RankFailure reached the caller: the watchdog stands down
        self._busy = 0  # the engine's calls inside a step here (where a lost rank can block)
        self._beat_error: BaseException | None = None
        self._heartbeat: Heartbeat | None = None
        self._sampled: SampledTokens | None = None
        if parallel.world_size > 1:
            if isinstance(inner, ModelRunner):
                self._sampled = SampledTokens(inner, parallel)
                inner._sample = self._sampled  # type: ignore[method-assign]
            dist.barrier(group=parallel.cpu_group)  # every rank is built: heartbeats from now
        atexit.register(self.close)
        if parallel.world_size > 1:
            self._heartbeat = Heartbeat(beat_group, 0, self._heartbeat_failed)
            threading.Thread(target=self._watch, name="inferx-tp-watchdog", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def lost(self) -> RankFailure | None:
        """Why a rank is gone, or None: a rank this process started exited, or a heartbeat
        round failed (a rank died or stopped answering, whoever started it)."""
        for rank, proc in enumerate(self.workers, 1):
            code = proc.poll()
            if code is not None:
                return RankFailure(f"tensor-parallel rank {rank} exited (code {code})")
        if self._beat_error is not None:
            return RankFailure(f"a tensor-parallel rank stopped answering ({self._beat_error})")
        return None

    def check(self) -> None:
        """Raise RankFailure if a rank is gone (see lost())."""
        if (failure := self.lost()) is not None:
            self._failed = self._reported = True
            raise failure

    def _heartbeat_failed(self, exc: BaseException) -> None:
        # a worker killed closes its sockets as it exits: give its exit a moment to show, so
        # that the failure names the rank
        deadline = time.monotonic() + 1.0
        while self.workers and all(p.poll() is None for p in self.workers):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._beat_error = exc

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """Around the engine's calls that run (or wait for) a step: a rank lost before is a
        RankFailure; a collective that fails is one too (the ranks are out of step); the
        watchdog sees the call in flight."""
        if self._closed or self._failed:
            self._reported = True
            if self._closed:
                raise RankFailure("the tensor-parallel ranks were shut down")
            raise RankFailure("an earlier step failed; the ranks are out of step")
        self._busy += 1
        try:
            self.check()
            yield
        except RankFailure:
            self._failed = self._reported = True
            raise
        except RuntimeError as exc:  # a collective failed (or the step): is a rank gone?
            self._failed = self._reported = True
            time.sleep(0.2)  # a rank killed mid-step: let its exit be seen
            self.check()
            raise RankFailure(f"a tensor-parallel step failed: {exc}") from exc
        except BaseException:
            self._failed = True
            raise
        finally:
            self._busy -= 1

    def execute(self, out: SchedulerOutput) -> StepResult:
        with self._step():
            self._send(out, share=False)
            return self.inner.execute(out)

    def submit(self, out: SchedulerOutput) -> PendingStep:
        with self._step():
            self._send(out, share=True)
            return _Collected(self, self.inner.submit(out))

    def _send(self, out: SchedulerOutput, share: bool) -> None:
        """The step's plan to the ranks; `share`: the step was submitted ahead, so the next
        one may read its sampled tokens on every rank. A step before it whose sampling waits
        for grammar masks samples (and broadcasts) first: the other ranks wait in that
        broadcast before they take the next plan. A world of one rank has no one to send
        it to: nothing is encoded or sent (at 256 sequences the plan costs ~1 ms of the
        scheduler's CPU a step)."""
        if self.parallel.world_size == 1:
            return
        if isinstance(self.inner, ModelRunner):
            self.inner.flush()
        if self._sampled is not None:
            self._sampled.share = share
        self.plan_bytes = send_plan((self._plans.encode(out), share), self.parallel.cpu_group)

    def _watch(self) -> None:
        """Rank 0's watchdog: a rank lost while the engine is inside a step here, which has
        neither returned nor raised STEP_GRACE_S later, ends the process (_fatal). Stands down
        once a RankFailure reached the engine, or at close()."""
        since: float | None = None
        while not (self._closed or self._reported):
            time.sleep(0.25)
            failure = self.lost() if self._busy else None
            if failure is None:
                since = None
            elif since is None:
                since = time.monotonic()
                log.error("%s while a step is in flight", failure)
            elif time.monotonic() - since >= STEP_GRACE_S and not self._reported:
                self._fatal(failure)

    def _fatal(self, failure: RankFailure) -> None:
        log.critical(
            "%s; the step in flight has not ended in %.0f s: exiting", failure, STEP_GRACE_S
        )
        if self.on_fatal is not None:
            with contextlib.suppress(Exception):
                self.on_fatal(failure)
        for proc in self.workers:
            with contextlib.suppress(OSError):
                proc.kill()
        os._exit(FATAL_EXIT)

    def close(self) -> None:
        """Tell the other ranks to exit, wait for them (killing those that do not), leave the
        process group. Safe to call twice; run at exit. After a failed step the ranks may be
        inside a collective rather than waiting for a plan: they are killed instead."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        failed = self._failed or self.lost() is not None
        if self._heartbeat is not None:  # ended first, so that the ranks' exit is no loss
            self._heartbeat.stop(wait=0.0 if failed else HEARTBEAT_S + 5.0)
        if failed:
            for proc in self.workers:
                if proc.poll() is None:
                    proc.kill()
        elif dist.is_initialized():
            with contextlib.suppress(Exception):  # a rank gone: the rest are killed below
                send_stop(self.parallel.cpu_group)
        _reap(self.workers)
        leave()


class _Collected:
    """A step rank 0 submitted ahead: its result is waited for inside the executor's _step(),
    so that a rank lost meanwhile is a RankFailure, and a wait it blocks is the watchdog's."""

    def __init__(self, executor: TensorParallelExecutor, pending: PendingStep) -> None:
        self.executor = executor
        self.pending = pending

    def result(self) -> StepResult:
        with self.executor._step():
            return self.pending.result()


class SampledTokens:
    """A rank's ModelRunner._sample under TP. Rank 0 samples; when the step was submitted
    ahead (`share`, from its plan) it then broadcasts the sampled ids over the model's group,
    and every other rank receives them where it would have sampled. So each rank holds the
    step's tokens on its device, and the next step's PENDING inputs are filled there from them
    as on one rank (_fill_pending). The broadcast is queued on the device after sampling, like
    the step's other collectives: no rank's host waits for it. Steps not submitted ahead send
    nothing (no later step reads their tokens on the device)."""

    def __init__(self, runner: ModelRunner, parallel: ParallelContext) -> None:
        self.runner = runner
        self.group = parallel.group
        self.rank = parallel.rank
        self.sample = runner._sample
        self.share = False

    def __call__(self, logits: torch.Tensor | None, seqs: list, *later: Any) -> PendingStep:
        """`later`: what rank 0's _sample takes for a step sampled after it was submitted."""
        runner = self.runner
        if self.rank == 0:
            step = self.sample(logits, seqs, *later)
            tokens = runner._last_sampled[0]
            if self.share and tokens is not None:
                dist.broadcast(tokens.long(), 0, group=self.group)  # long already: no copy
            return step
        runner._last_sampled = (None, {})
        if self.share and logits is not None and seqs:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=runner.device)
            dist.broadcast(tokens, 0, group=self.group)
            runner._last_sampled = (tokens, {id(s): i for i, s in enumerate(seqs)})
        return DoneStep(StepResult(sampled=[]))


def _reap(workers: list[Any], wait: float = 10.0) -> None:
    deadline = time.monotonic() + wait
    for proc in workers:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_tensor_parallel_executor(config: Config, reg: Plugins | None = None) -> Executor:
    """Rank 0's executor over parallel.tensor ranks, the others started here (or by torchrun).
    Under torchrun a rank above 0 runs the worker loop here and exits the process."""
    world = tensor_parallel_size(config)
    launched = torchrun_env()
    if world == 1 and not config.parallel.distributed_executor:
        # WORLD_SIZE 1, or set without the rest of torchrun's environment: the plain executor
        reg = reg or plugins()
        device = resolve_device(config.engine.device)
        cls = reg.get("executor", pick_executor(config.engine.executor, device, reg))
        return cls(config, reg)  # type: ignore[operator]
    if dist.is_initialized():
        raise ConfigError(
            "parallel.tensor: this process already belongs to a torch.distributed group (another "
            "tensor-parallel engine still open?); close its executor first"
        )
    if launched is not None and launched[1] > 1:
        rank, _, local_rank = launched
        if rank != 0:
            code = worker_loop(config, rank, world, local_rank, "env://", reg=reg)
            sys.exit(exit_if_joined(code))
        parallel, beat = join(config, 0, world, local_rank, "env://")
        try:
            inner = build_rank_executor(config, parallel, reg)
            return TensorParallelExecutor(inner, parallel, [], beat)
        except BaseException:
            leave()
            raise
    init = f"tcp://127.0.0.1:{free_port()}"
    errors = Path(tempfile.mkdtemp(prefix="inferx-tp-"))
    workers = [_start_worker(config, rank, world, init, errors) for rank in range(1, world)]
    try:
        parallel, beat = join(config, 0, world, 0, init)
        inner = build_rank_executor(config, parallel, reg)
        executor = TensorParallelExecutor(inner, parallel, workers, beat)
    except BaseException as exc:
        time.sleep(0.5)  # a rank that failed first: let it finish writing why
        reason = _worker_error(errors)
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
        _reap(workers)
        leave()
        if reason and not isinstance(exc, (ConfigError, LoadError)):
            raise LoadError(reason) from exc
        raise
    finally:
        shutil.rmtree(errors, ignore_errors=True)
    return executor


def _worker_error(errors: Path) -> str:
    """The first error a worker wrote (by rank), or ''."""
    for path in sorted(errors.glob("rank-*")):
        text = path.read_text().strip()
        if text:
            return text
    return ""


def _start_worker(config: Config, rank: int, world: int, init: str, errors: Path) -> Any:
    args = [sys.executable, "-m", "inferx_core.distributed", str(rank), str(world), init]
    args += [str(errors / f"rank-{rank}"), str(os.getpid())]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()
    return proc


def build_rank_executor(
    config: Config, parallel: ParallelContext, reg: Plugins | None = None
) -> Executor:
    """This rank's executor (engine.executor, or auto's pick) built with its ParallelContext;
    a world size that does not fit the model is a LoadError naming parallel.tensor."""
    reg = reg or plugins()
    device = resolve_device(config.engine.device)
    cls = reg.get("executor", pick_executor(config.engine.executor, device, reg))
    if not (isinstance(cls, type) and issubclass(cls, ModelRunner)):
        raise ConfigError(
            f"parallel.tensor = {parallel.world_size}: engine.executor {cls.__name__} "
            "does not run sharded models (it is not a ModelRunner)"
        )
    try:
        return cls(config, reg, parallel=parallel)
    except (ValueError, NotImplementedError) as exc:  # a model or layer that does not shard
        if "parallel.tensor" in str(exc):
            model = config.model.preset or config.model.path or "the model"
            raise LoadError(f"{model}: {exc}") from None
        raise


# -- ranks above 0 -------------------------------------------------------------------------------


def worker_loop(
    config: Config,
    rank: int,
    world: int,
    local_rank: int,
    init: str,
    reg: Plugins | None = None,
) -> int:
    """Join, build this rank's executor, then run every plan rank 0 sends until it says stop
    (returns 0) or goes away (returns 1). A failed heartbeat (rank 0 or another rank gone,
    perhaps while this one is blocked in a collective) ends the process with exit code 1."""
    parallel, beat = join(config, rank, world, local_rank, init)
    try:
        runner = build_rank_executor(config, parallel, reg)
    except BaseException:
        leave()
        raise
    assert isinstance(runner, ModelRunner)  # build_rank_executor's
    sampled = SampledTokens(runner, parallel)  # rank 0 samples; this rank receives
    runner._sample = sampled  # type: ignore[method-assign]
    plans = PlanDecoder()
    try:
        dist.barrier(group=parallel.cpu_group)  # every rank is built (TensorParallelExecutor)
        heartbeat = Heartbeat(beat, rank, lambda exc: _lost_peer(rank, exc))
        while (msg := receive_plan(parallel.cpu_group)) is not None:
            plan, sampled.share = msg
            runner.execute(plans.decode(plan))
        heartbeat.stop(wait=HEARTBEAT_S + 5.0)  # ended by rank 0's last round already
        return 0
    except RuntimeError as exc:  # rank 0 (or another rank) went away mid-collective
        print(f"inferx tensor-parallel rank {rank}: stopping: {exc}", file=sys.stderr)
        return 1
    finally:
        leave()


def _lost_peer(rank: int, exc: BaseException) -> None:
    """A worker's heartbeat failed: rank 0 (or another rank) is gone. The main thread may be
    blocked in a collective that would wait for its timeout, so the process ends here."""
    print(f"inferx tensor-parallel rank {rank}: stopping: a rank is gone ({exc})", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def _watch_parent(pid: int) -> None:
    """Exit this process once the process that started it is gone (killed, crashed)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != pid:
            os._exit(1)


def _worker_main(argv: list[str]) -> int:
    rank, world, init, error_file, parent = argv
    threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    config = pickle.loads(sys.stdin.buffer.read())
    try:
        return worker_loop(config, int(rank), int(world), int(rank), init)
    except (ConfigError, LoadError, ValueError, NotImplementedError) as exc:  # rank 0 says so too
        _write(error_file, f"tensor-parallel rank {rank}: {exc}")
        return 1
    except BaseException as exc:
        _write(error_file, f"tensor-parallel rank {rank}: {exc!r}")
        raise


def _write(path: str, text: str) -> None:
    with contextlib.suppress(OSError):  # rank 0 is past start-up and removed the folder
        Path(path).write_text(text)


if __name__ == "__main__":
    sys.exit(exit_if_joined(_worker_main(sys.argv[1:])))
