"""The sampler against plain references: filters, penalties, seeds, greedy."""

from __future__ import annotations

import pytest
import torch

from inferx_core.sampler import Sampler, apply_penalties, filter_logits
from inferx_core.sequence import PENDING, SamplingParams, Sequence


def seqs(params: list[SamplingParams], tokens: list[list[int]] | None = None) -> list[Sequence]:
    tokens = tokens or [[1, 2, 3]] * len(params)
    return [Sequence(t, p) for t, p in zip(tokens, params, strict=True)]


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]


def test_top_k_keeps_exactly_k_largest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64)
    out = filter_logits(logits.clone(), torch.tensor([1, 5, 0]), torch.ones(3), torch.zeros(3))
    sets = kept(out)
    for row, k in zip(range(3), [1, 5, 50], strict=True):
        assert sets[row] == set(logits[row].topk(k).indices.tolist())


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]], dtype=torch.float64)
    logits = probs.log()
    for p, size in [(0.5, 1), (0.6, 2), (0.79, 2), (0.81, 3), (0.95, 4), (1.0, 5)]:
        out = filter_logits(logits.clone(), torch.tensor([0]), torch.tensor([p]), torch.zeros(1))
        assert kept(out)[0] == set(range(size)), p


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]], dtype=torch.float64)
    out = filter_logits(probs.log(), torch.tensor([0]), torch.ones(1), torch.tensor([0.15]))
    assert kept(out)[0] == {0, 1, 2}  # 0.15 * 0.5 = 0.075


def test_repetition_penalty_follows_hf_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), seqs([p], [[0, 1]]))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, 5)
    seq = Sequence([4, 4], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    seq.token_ids += [1, 1, 2]
    out = apply_penalties(logits.clone(), [seq])
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0, 0.0]]


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 100, generator=g)
    tokens, top = Sampler(torch.device("cpu"))(
        logits, seqs([SamplingParams(temperature=0, logprobs=2)] * 4)
    )
    assert tokens.tolist() == logits.argmax(1).tolist()
    assert top.ids.tolist() == logits.topk(2).indices.tolist()
    assert torch.equal(top.sampled, top.values[:, 0])  # the greedy token is the most likely
    assert bool((top.values.exp().sum(1) < 1).all())
    _, none = Sampler(torch.device("cpu"))(logits, seqs([SamplingParams(temperature=0)] * 4))
    assert none is None  # not computed when nobody asked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_on_half_logits_picks_what_float32_would(dtype: torch.dtype) -> None:
    """All-greedy steps take the argmax of the logits as they come (no float32 copy): the same
    tokens as the float32 path, ties to the first index included. A row with a penalty or
    logprobs sends the step through float32, and logprobs come back in float32."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 300, generator=g).to(dtype)
    logits[1, 10] = logits[1, 250] = logits[1].max() + 1  # a tie: the first index wins
    sampler = Sampler(torch.device("cpu"))
    tokens, top = sampler(logits, seqs([SamplingParams(temperature=0)] * 6))
    assert top is None
    assert tokens.tolist() == logits.float().argmax(1).tolist()
    assert tokens[1].item() == 10
    penalised = [SamplingParams(temperature=0)] * 5 + [
        SamplingParams(temperature=0, repetition_penalty=1.5)
    ]
    history = [[1]] * 5 + [[int(logits[5].float().argmax())]]
    want, _ = sampler(logits.float(), seqs(penalised, history))
    got, _ = sampler(logits, seqs(penalised, history))
    assert got.tolist() == want.tolist()
    assert got[5].item() != history[5][0]  # the penalty moved row 5 off its argmax
    _, top = sampler(logits, seqs([SamplingParams(temperature=0, logprobs=3)] * 6))
    assert top is not None and top.values.dtype == torch.float32


def test_every_argmax_goes_through_the_injected_one() -> None:
    """The executor hands the sampler its KernelOps.argmax: greedy rows, the exponential race of
    sampled rows and a mixed step's greedy rows all take their argmax there."""
    calls: list[torch.dtype] = []

    def argmax(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.dtype)
        return x.argmax(dim=1)

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g).to(torch.bfloat16)
    sampler = Sampler(torch.device("cpu"), argmax=argmax)
    tokens, _ = sampler(logits, seqs([SamplingParams(temperature=0)] * 4))
    assert calls == [torch.bfloat16] and tokens.tolist() == logits.argmax(1).tolist()
    calls.clear()
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)] * 2
    tokens, _ = sampler(logits, seqs(mixed))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert calls == [torch.float32, torch.float32]  # the race, then the greedy rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_greedy_on_bf16_logits_picks_what_float32_would() -> None:
    """The same on the GPU at a real vocabulary (Qwen2.5's 151,936) and batch 64, fresh logits,
    a planted tie per row: CUDA's argmax over bf16 gives float32's token, the first index."""
    vocab, rows = 151_936, 64
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    top = logits.float().max(1).values + 1
    cols = torch.randint(0, vocab - 1, (rows,), device="cuda")
    logits[torch.arange(rows, device="cuda"), cols] = top.to(torch.bfloat16)
    logits[torch.arange(rows, device="cuda"), cols + 1] = top.to(torch.bfloat16)
    tokens, _ = Sampler(torch.device("cuda"))(logits, seqs([SamplingParams(temperature=0)] * rows))
    assert tokens.tolist() == logits.float().argmax(1).tolist() == cols.tolist()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(torch.device("cpu"), seed=3)
    tokens, _ = sampler(logits, seqs([SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1000, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=42)
    a, _ = Sampler(torch.device("cpu"), seed=0)(logits[:1], seqs([seeded]))
    b, _ = Sampler(torch.device("cpu"), seed=99)(
        logits, seqs([seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)])
    )
    assert a[0] == b[0]


def test_torch_rotary_reuses_lookup_only_for_the_same_positions():
    from inferx_core.ops_torch import TorchOps

    ops = TorchOps()
    table = torch.randn(64, 8)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    a = ops.rotary(torch.tensor([1, 2, 3]), q, k, table)
    b = ops.rotary(torch.tensor([4, 5, 6]), q, k, table)  # a new tensor: a fresh lookup
    fresh = TorchOps().rotary(torch.tensor([4, 5, 6]), q, k, table)
    assert torch.equal(b[0], fresh[0]) and not torch.equal(a[0], b[0])


def test_seeded_sampling_follows_the_distribution():
    # Different seeds are independent draws: over 4000 seeds the frequencies match p.
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    rows = seqs([SamplingParams(temperature=1.0, seed=s) for s in range(4000)])
    tokens, _ = Sampler(torch.device("cpu"))(logits, rows)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeds_span_int64_and_no_further():
    """Any int64 seed samples (the noise is int64 arithmetic that wraps); a larger one is
    refused where the request arrives: past int64 it raised inside the engine's step and took
    the server's engine loop down with it."""
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (2**63 - 1, -(2**63))]
    tokens, _ = Sampler(torch.device("cpu"))(logits, seqs(params))
    assert all(0 <= t < 50 for t in tokens.tolist())
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)


def test_seeded_noise_changes_with_the_output_index():
    from inferx_core.sampler import seeded_exponential

    a = seeded_exponential(torch.tensor([7, 7]), torch.tensor([0, 1]), 1000)
    again = seeded_exponential(torch.tensor([7]), torch.tensor([1]), 1000)
    assert not torch.equal(a[0], a[1]) and torch.equal(a[1], again[0])
    assert abs(float(a.mean()) - 1.0) < 0.1 and bool((a > 0).all())


def with_output(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    """A sequence as the sampler gets it: prompt, output so far, and the PENDING token that the
    scheduler appended for the token being sampled."""
    seq = Sequence(prompt, params)
    seq.token_ids += output + [PENDING]
    seq.num_pending = 1
    return seq


def reference_penalties(logits: torch.Tensor, rows: list[Sequence]) -> torch.Tensor:
    """apply_penalties row by row and token by token in float64."""
    out = logits.double().clone()
    for i, seq in enumerate(rows):
        p = seq.params
        if p.repetition_penalty != 1.0:
            for t in set(seq.known_ids):  # never PENDING (-1 would index the last token)
                x = out[i, t]
                out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(seq.output_ids):
            count = seq.output_ids.count(t)
            out[i, t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_batched_penalties_match_a_per_row_reference():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 64, generator=g) * 3
    rows = [
        with_output([1, 2, 3], [5, 5, 5, 9], SamplingParams(repetition_penalty=1.3)),
        with_output([4, 4], [7, 7, 8], SamplingParams(presence_penalty=0.7)),
        with_output([1], [2, 2, 2, 2, 63], SamplingParams(frequency_penalty=-0.4)),
        with_output([3, 9], [9, 9, 0], SamplingParams()),
        with_output(
            [10, 11, 12],
            [11, 20, 20, 0, 20],
            SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=1.25),
        ),
        Sequence([30, 31], SamplingParams(presence_penalty=2.0, repetition_penalty=1.5)),
    ]
    out = apply_penalties(logits.clone(), rows)
    ref = reference_penalties(logits, rows)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-5)
    assert torch.equal(out[3], logits[3])  # no penalties: the row is untouched
    changed = (out != logits).sum(1).tolist()
    assert changed == [5, 2, 2, 0, 5, 2]  # prompt+output set; output set; ...; prompt only


def reference_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list:
    lp = torch.log_softmax(logits.double(), dim=1)
    out = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        top = lp[i].topk(k)
        alts = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out.append((float(lp[i, tokens[i]]), alts))
    return out


def assert_logprobs_close(got: list, want: list) -> None:
    """Same rows asked, same tokens in the same order, logprobs within 1e-5."""
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in zip(got, want, strict=True):
        if g is None:
            continue
        assert abs(g[0] - w[0]) < 1e-5, (g[0], w[0])
        assert [t for t, _ in g[1]] == [t for t, _ in w[1]]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(g[1], w[1], strict=True))


def test_top_logprobs_rows_match_log_softmax():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 200, generator=g) * 4
    ks = [None, 0, 1, 5, 3]
    params = [
        SamplingParams(temperature=1.0, logprobs=ks[0]),
        SamplingParams(temperature=0.7, top_k=10, logprobs=ks[1]),
        SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=ks[2]),
        SamplingParams(temperature=1.0, seed=3, frequency_penalty=1.0, logprobs=ks[3]),
        SamplingParams(temperature=1.2, top_p=0.5, logprobs=ks[4]),
    ]
    rows = [with_output([1, 2], [4, 4], p) for p in params]
    tokens, top = Sampler(torch.device("cpu"))(logits.clone(), rows)
    assert top.ids.shape == (5, 5) and top.values.shape == (5, 5) and top.sampled.shape == (5,)
    got = top.copy_to_host().rows(ks)
    # Under the raw logits: the penalised rows' logprobs are not those of the penalised logits.
    assert_logprobs_close(got, reference_logprobs(logits, tokens.tolist(), ks))
    assert got[0] is None and [len(r[1]) for r in got[1:]] == [0, 1, 5, 3]


def test_top_logprobs_with_k_zero_everywhere():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(7))
    tokens, top = Sampler(torch.device("cpu"))(logits, seqs([SamplingParams(logprobs=0)] * 3))
    assert top.ids.shape == (3, 0)
    got = top.copy_to_host().rows([0, 0, None])
    assert_logprobs_close(got, reference_logprobs(logits, tokens.tolist(), [0, 0, None]))
    assert got[2] is None and [r[1] for r in got[:2]] == [[], []]


def test_seeded_rows_draw_at_output_index():
    from inferx_core.sampler import output_index, seeded_exponential

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(8))
    rows = [with_output([1], [2, 3, 4], SamplingParams(seed=11)), Sequence([1], SamplingParams())]
    tokens, _ = Sampler(torch.device("cpu"))(logits, rows)
    noise = seeded_exponential(torch.tensor([11]), torch.tensor([output_index(rows[0])]), 300)
    assert output_index(rows[0]) == 3  # the fourth output token
    assert tokens[0] == (logits[:1].softmax(1) / noise).argmax(1)[0]


def _no_host_read(*args, **kwargs):
    raise AssertionError("the sampler read a tensor value on the host")


def test_sampler_never_reads_a_tensor_on_the_host(monkeypatch):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 500, generator=g) * 3
    logits[5, 7] = logits[5].max() + 0.5  # repeated: the penalty moves row 5's argmax
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.6, logprobs=3),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.0, seed=1234, logprobs=0),
        SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, seed=5),
    ]
    rows = [with_output([1, 2, 3], [7, 7, 8], p) for p in params]
    sampler = Sampler(torch.device("cpu"), seed=4)
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, _no_host_read)
        with pytest.raises(AssertionError, match="on the host"):
            bool(torch.tensor(True))  # the patch is live
        tokens, top = sampler(logits.clone(), rows)
    tokens = tokens.tolist()
    penalised = apply_penalties(logits.clone(), rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[5] == int(penalised[5].argmax()) != 7
    assert tokens[1] in (logits[1] / 0.8).topk(20).indices.tolist()
    probs = logits[3].softmax(0)
    assert probs[tokens[3]] >= 0.2 * probs.max()
    again, _ = Sampler(torch.device("cpu"), seed=99)(logits.clone(), rows)
    assert again.tolist()[4] == tokens[4] and again.tolist()[6] == tokens[6]  # seeded
    ks = [p.logprobs for p in params]
    assert_logprobs_close(top.copy_to_host().rows(ks), reference_logprobs(logits, tokens, ks))


def test_logit_bias_forces_and_bans_tokens_greedy_or_not():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=g)
    best = logits.argmax(dim=1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0, logit_bias={best[1]: -100.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=5, logit_bias={11: 100.0}),
    ]
    tokens, _ = Sampler(torch.device("cpu"))(logits.clone(), seqs(params))
    assert tokens.tolist()[0] == 7
    assert tokens.tolist()[1] == logits[1].topk(2).indices[1].item()  # the runner-up
    assert tokens.tolist()[2] == best[2]  # no bias: untouched
    assert tokens.tolist()[3] == 11


def test_logit_bias_leaves_logprobs_raw():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=0, logprobs=1, logit_bias=((5, 100.0),))
    tokens, lp = Sampler(torch.device("cpu"))(logits.clone(), seqs([p]))
    assert tokens.tolist() == [5]
    want = torch.log_softmax(logits, dim=1)[0]
    assert lp.sampled.item() == pytest.approx(want[5].item(), abs=1e-5)


def test_logit_bias_params_are_hashable_and_checked():
    p = SamplingParams(logit_bias={3: 1.5, 1: -2})
    assert p.logit_bias == ((1, -2.0), (3, 1.5)) and hash(p) == hash(SamplingParams(**p.__dict__))
    with pytest.raises(ValueError, match="outside"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="negative"):
        SamplingParams(logit_bias={-1: 1})
