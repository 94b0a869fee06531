"""The engine with one step in flight (engine.overlap) against the same engine stepping in series,
on the CPU with the real model runner: the same tokens, finish reasons and logprobs, for a mix of
greedy, seeded, stopping, penalised and aborted requests; the device-side hand-over of PENDING
tokens is used; every KV block comes back."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_engine import PROMPTS, checkpoint, make_llm  # noqa: E402, F401

from inferx_core.sequence import SamplingParams  # noqa: E402


def spy_fills(llm) -> list[int]:
    """Counts the PENDING tokens the executor takes from the previous step on the device."""
    ex = llm.engine.executor
    real = ex._fill_pending
    calls: list[int] = []

    def spy(input_ids, rows, chunks, pending):
        calls.append(len(rows))
        return real(input_ids, rows, chunks, pending)

    ex._fill_pending = spy
    return calls


def mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=1.0, top_k=20, min_p=0.05, seed=3),
    ]


def run(path, overlap: bool, params, **overrides):
    llm = make_llm(path, **{"engine.overlap": overlap, **overrides})
    fills = spy_fills(llm)
    done = llm.generate(PROMPTS, params)
    kv = llm.engine.kv
    assert kv.num_free_blocks() == kv.num_usable_blocks  # cached blocks count as free
    return done, fills, llm


def as_tuples(done):
    return [(c.token_ids, c.finish_reason) for c in done]


def assert_logprobs_close(a, b, tol: float = 1e-5) -> None:
    """Steps may batch differently with overlap on (fp32 sums in another order): same tokens,
    logprobs within tol."""
    for x, y in zip(a, b, strict=True):
        assert (x.logprobs is None) == (y.logprobs is None)
        for (lp, top), (lq, toq) in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert abs(lp - lq) <= tol and [t for t, _ in top] == [t for t, _ in toq]
            assert all(abs(u - v) <= tol for (_, u), (_, v) in zip(top, toq, strict=True))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "scheduler.prefill_chunk": 7,
            "scheduler.max_batched_tokens": 16,
            "scheduler.max_running": 4,
        },
        {"kv_cache.block_size": 4, "kv_cache.num_blocks": 40, "scheduler.prefix_cache": False},
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_overlap_generates_what_serial_steps_generate(checkpoint, overrides):  # noqa: F811
    path = checkpoint[0]
    probe, _, _ = run(path, False, [SamplingParams(max_tokens=30, temperature=0)] * 5)
    stop_token = probe[2].token_ids[5]  # request 2 stops early on a token it generates
    params = mixed_params(stop_token)
    preempting = "kv_cache.num_blocks" in overrides
    if preempting:  # long enough that the five cannot all hold their blocks (test_engine's case)
        params = [p.model_copy(update={"max_tokens": 32}) for p in params]
    serial, serial_fills, _ = run(path, False, params, **overrides)
    overlapped, fills, llm = run(path, True, params, **overrides)
    assert as_tuples(overlapped) == as_tuples(serial)
    assert_logprobs_close(overlapped, serial)
    assert [c.prompt_token_ids for c in overlapped] == PROMPTS
    assert serial[0].logprobs is not None
    assert len(serial[0].logprobs) == len(serial[0].token_ids) == (32 if preempting else 24)
    assert serial[2].finish_reason == "stop" and len(serial[2].token_ids) <= 6
    assert len(serial[3].token_ids) == (32 if preempting else 1)
    assert not serial_fills, "serial steps never see a PENDING input"
    assert sum(fills) > 0, "overlapped decodes take their input token from the device"
    if preempting:
        assert llm.engine.scheduler.stats().preemptions > 0


def test_penalised_requests_are_stepped_in_series(checkpoint):  # noqa: F811
    """Penalties read the generated tokens on the host: a step with such a request is
    collected before the next is scheduled, and tokens equal serial stepping."""
    path = checkpoint[0]
    params = [
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, seed=5, repetition_penalty=0.9),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.2, ignore_eos=True),
    ]
    serial, _, _ = run(path, False, params)
    overlapped, fills, _ = run(path, True, params)
    assert as_tuples(overlapped) == as_tuples(serial)
    assert not fills


def test_abort_while_a_step_is_in_flight_frees_everything(checkpoint):  # noqa: F811
    path = checkpoint[0]
    llm = make_llm(path, **{"engine.overlap": True, "scheduler.prefix_cache": False})
    engine = llm.engine
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in PROMPTS[:3]]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(4):
        for o in engine.step():
            outputs[o.request_id] += o.token_ids
    assert engine._in_flight is not None, "a step is on the device between calls"
    cut = len(outputs[ids[1]])
    assert engine.abort(ids[1])
    while engine.has_work():
        for o in engine.step():
            outputs[o.request_id] += o.token_ids
    assert len(outputs[ids[1]]) == cut  # nothing after the abort, not even the step in flight
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], greedy)
    assert [outputs[ids[0]], outputs[ids[2]]] == [c.token_ids for c in alone]
    assert engine.kv.usage() == 0.0 and not engine.has_work()


def test_auto_overlaps_except_on_the_cpu(checkpoint):  # noqa: F811
    """engine.overlap = "auto" (the default): off for an executor on the CPU (submitting a step
    there runs it, so overlap would only hold each output back a step), on for executors that
    are not (stand-ins without a device count as a device)."""
    from fake_executor import FakeExecutor

    from inferx_core.config import load_config
    from inferx_core.engine import Engine

    path, _ = checkpoint
    assert make_llm(path).engine.overlap is False
    assert make_llm(path, **{"engine.overlap": True}).engine.overlap is True
    config = load_config(None, {})
    assert config.engine.overlap == "auto"
    assert Engine(config, executor=FakeExecutor(64, 16)).overlap is True


def test_pending_tokens_land_in_their_rows_by_slice_or_by_index():
    """_fill_pending: tokens sampled last step go to the rows of the sequences that wait on
    them, whether the rows and their sources are two runs (one slice copy) or not (an index)."""
    import types

    import torch

    from inferx_core.executor import ModelRunner

    seqs = [object() for _ in range(4)]
    chunks = [types.SimpleNamespace(seq=s) for s in seqs]
    tokens = torch.tensor([10, 11, 12, 13])
    identity = {id(s): i for i, s in enumerate(seqs)}
    cases = [  # input rows, chunks waiting, where each one's token was sampled, the ids after
        ([0, 1, 2, 3], [0, 1, 2, 3], identity, [10, 11, 12, 13, -1]),
        ([1, 2, 3, 4], [0, 1, 2, 3], identity, [-1, 10, 11, 12, 13]),
        (
            [0, 1, 2, 3],
            [0, 1, 2, 3],
            {id(s): 3 - i for i, s in enumerate(seqs)},
            [13, 12, 11, 10, -1],
        ),
        ([0, 2], [0, 2], identity, [10, -1, 12, -1, -1]),
    ]
    for rows, pending, row_of, want in cases:
        runner = types.SimpleNamespace(_last_sampled=(tokens, row_of), device=torch.device("cpu"))
        input_ids = torch.full((5,), -1)
        ModelRunner._fill_pending(runner, input_ids, rows, chunks, pending)
        assert input_ids.tolist() == want, (rows, pending, want)
