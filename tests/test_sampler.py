"""The sampler against plain references: filters, penalties, seeds, greedy."""

from __future__ import annotations

import torch

from inferx_core.sampler import Sampler, apply_penalties, filter_logits
from inferx_core.sequence import SamplingParams, Sequence


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
    tokens, logprobs = Sampler(torch.device("cpu"))(
        logits, seqs([SamplingParams(temperature=0, logprobs=2)] * 4)
    )
    assert tokens.tolist() == logits.argmax(1).tolist()
    assert torch.allclose(logprobs.exp().sum(1), torch.ones(4))
    _, none = Sampler(torch.device("cpu"))(logits, seqs([SamplingParams(temperature=0)] * 4))
    assert none is None  # not computed when nobody asked


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


def test_seeded_noise_changes_with_the_output_index():
    from inferx_core.sampler import seeded_exponential

    a = seeded_exponential(torch.tensor([7, 7]), torch.tensor([0, 1]), 1000)
    again = seeded_exponential(torch.tensor([7]), torch.tensor([1]), 1000)
    assert not torch.equal(a[0], a[1]) and torch.equal(a[1], again[0])
    assert abs(float(a.mean()) - 1.0) < 0.1 and bool((a > 0).all())
