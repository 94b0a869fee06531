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
