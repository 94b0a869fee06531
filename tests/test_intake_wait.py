"""server.intake_wait_ms: an idle engine handed a request while other requests are still being
tokenized waits for them (up to the window), so that a burst's prompts share one step instead of
the first running alone. Checked on the engine thread (EngineLoop) and in the engine's child
process (ProcessEngineLoop), by when each request's first token came out."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
from test_engine_process import fake_engine
from test_server_api import QWEN, FakeExecutor  # noqa: E402

from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import Engine  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_server.engine_loop import EngineLoop, ProcessEngineLoop  # noqa: E402
from inferx_server.engine_process import EngineProcess  # noqa: E402
from inferx_server.requests import _encode  # noqa: E402

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def thread_loop(wait: float, on_output: Any) -> EngineLoop:
    from inferx_core.tokenizer import Tokenizer

    engine = Engine(
        load_config(None, {}),
        executor=FakeExecutor(step_delay=0.002),
        tokenizer=Tokenizer.from_dir(QWEN),
    )
    return EngineLoop(engine, on_output=on_output, intake_wait=wait)


def process_loop(wait: float, on_output: Any) -> EngineLoop:
    return ProcessEngineLoop(
        EngineProcess(partial(fake_engine, {})), on_output=on_output, intake_wait=wait
    )


LOOPS = {"thread": thread_loop, "process": process_loop}


def first_tokens(make: Any, wait: float, late: float | None) -> dict[str, float]:
    """Request "a" is handed over while another is being tokenized; "b" follows `late` seconds
    later (None: never, and the tokenizing never ends). When each one's first token came out
    (one engine step's outputs share a time), and when "a" was handed over."""
    firsts: dict[str, float] = {}

    def on_output(sub: Any, index: int, out: Any, t: float) -> None:
        firsts.setdefault(sub.rids[index], t)

    async def run() -> None:
        loop = make(wait, on_output)
        loop.start()
        try:
            loop.encoding = 1  # another request's prompt is being tokenized
            firsts["handed"] = time.monotonic()
            subs = [await loop.submit([([11, 12, 13], PARAMS)], "a")]
            if late is not None:
                await asyncio.sleep(late)
                loop.encoding = 0  # ... and is handed over now
                subs.append(await loop.submit([([21, 22, 23], PARAMS)], "b"))
            for sub in subs:
                async for _ in loop.outputs(sub):
                    pass
        finally:
            await asyncio.to_thread(loop.stop)

    asyncio.run(run())
    return firsts


@pytest.mark.parametrize("where", LOOPS)
def test_a_burst_shares_the_first_step(where: str) -> None:
    firsts = first_tokens(LOOPS[where], wait=2.0, late=0.05)
    assert firsts["a-0"] == firsts["b-0"]  # the same step's outputs


@pytest.mark.parametrize("where", LOOPS)
def test_without_the_wait_the_first_request_runs_alone(where: str) -> None:
    firsts = first_tokens(LOOPS[where], wait=0.0, late=0.05)
    assert firsts["a-0"] < firsts["b-0"]


@pytest.mark.parametrize("where", LOOPS)
def test_the_wait_ends_with_its_window(where: str) -> None:
    """A request still tokenizing after the window does not hold the first one any longer."""
    firsts = first_tokens(LOOPS[where], wait=0.2, late=None)
    waited = firsts["a-0"] - firsts["handed"]
    assert 0.15 < waited < 5.0


class _Ready:
    """A step submitted to DeviceExecutor: its result when the "device" has run it."""

    def __init__(self, value: Any, at: float) -> None:
        self.value, self.at = value, at

    def result(self) -> Any:
        time.sleep(max(0.0, self.at - time.monotonic()))
        return self.value


class DeviceExecutor(FakeExecutor):
    """FakeExecutor as a device runs it with overlap: submit() returns at once, and a step
    finishes LONG_S after the one before it when it has 500 tokens or more (2 ms otherwise)."""

    supports_overlap = True

    def __init__(self) -> None:
        super().__init__(max_model_len=8192)
        self.free_at = 0.0

    def submit(self, out: Any) -> _Ready:
        start = max(time.monotonic(), self.free_at)
        self.free_at = start + (LONG_S if out.num_tokens >= 500 else 0.002)
        return _Ready(self.execute(out), self.free_at)


LONG_S = 1.0
BUSY_WAIT_S = 0.2
BIG = {
    "scheduler.max_batched_tokens": 4096,
    "scheduler.prefill_chunk": 4096,
    "server.intake_busy_ms": BUSY_WAIT_S * 1e3,
}
BUSY = load_config(None, {}).server.intake_busy_tokens  # the child reads it from its config


def device_engine(overrides: dict[str, Any]) -> Any:
    """Runs in the child (or on the thread): an Engine over DeviceExecutor."""
    from inferx_core.tokenizer import Tokenizer

    return Engine(
        load_config(None, {**BIG, **overrides}),
        executor=DeviceExecutor(),
        tokenizer=Tokenizer.from_dir(QWEN),
    )


BUSY_LOOPS = {
    "thread": lambda on_output: EngineLoop(
        device_engine({}),
        on_output=on_output,
        intake_busy_tokens=BUSY,
        intake_busy_wait=BUSY_WAIT_S,
    ),
    "process": lambda on_output: ProcessEngineLoop(
        EngineProcess(partial(device_engine, {})), on_output=on_output
    ),
}


def output_times(make: Any, prompt_len: int) -> dict[str, list[float]]:
    """Request "a" (prompt_len tokens) goes to an idle engine, "b" half the busy wait later,
    while a's prompt step (LONG_S) is on the device. When each request's outputs came out
    (one step's outputs share a time)."""
    times: dict[str, list[float]] = {}

    def on_output(sub: Any, index: int, out: Any, t: float) -> None:
        times.setdefault(sub.rids[index], []).append(t)

    async def run() -> None:
        loop = make(on_output)
        loop.start()
        try:
            subs = [await loop.submit([(list(range(3, 3 + prompt_len)), PARAMS)], "a")]
            await asyncio.sleep(BUSY_WAIT_S / 2)
            subs.append(await loop.submit([([21, 22, 23], PARAMS)], "b"))
            for sub in subs:
                async for _ in loop.outputs(sub):
                    pass
        finally:
            await asyncio.to_thread(loop.stop)

    asyncio.run(run())
    return times


@pytest.mark.parametrize("where", BUSY_LOOPS)
def test_requests_join_the_step_after_a_long_one(where: str) -> None:
    """Behind a step of server.intake_busy_tokens or more on the device, the engine takes the
    requests of the next intake_busy_ms before it schedules the next step: b's prompt runs
    beside a's first decode. Behind a shorter step (as long on this device) it does not: b's
    prompt waits for the step after, as every request did before."""
    times = output_times(BUSY_LOOPS[where], BUSY)
    assert times["b-0"][0] == times["a-0"][1]
    times = output_times(BUSY_LOOPS[where], BUSY // 2)
    assert times["b-0"][0] == times["a-0"][2]


def test_encode_counts_what_it_is_tokenizing() -> None:
    """requests._encode counts a long text while it is on its worker thread (the count the loop
    reads), and uncounts it even when the tokenizer fails."""
    seen: list[int] = []
    loop = SimpleNamespace(encoding=0)

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1]

        def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list:
            seen.append(loop.encoding)
            if texts[0].startswith("x"):
                raise ValueError("bad text")
            return [[1, 2]] * len(texts)

    srv = SimpleNamespace(tokenizer=Tok(), loop=loop)
    assert asyncio.run(_encode(srv, ["short"])) == [[1]]  # on the loop: not counted
    assert asyncio.run(_encode(srv, ["y" * 2000])) == [[1, 2]]
    with pytest.raises(ValueError, match="bad text"):
        asyncio.run(_encode(srv, ["x" * 2000]))
    assert seen == [1, 1]
    assert loop.encoding == 0
