"""Turns a step's logits into tokens on the logits' own device: penalties, temperature, top-k,
top-p, min-p, per-request seeds, and the logprobs a request asked for.

Seeded requests draw from a generator seeded by (seed, output position), so a request's tokens do
not depend on what else is in the batch or on whether it was preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from inferx_core.sequence import SamplingParams, Sequence

_MASK = float("-inf")


def apply_penalties(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Repetition (over prompt and output, Hugging Face's rule), presence and frequency (over
    output, OpenAI's rule) penalties, in place, row by row for the rows that asked."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
            picked = logits[i, ids]
            logits[i, ids] = torch.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output:
            out = torch.tensor(seq.output_ids, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask tokens outside top-k (0 = off), outside the top-p nucleus, and below min_p times the
    most likely token's probability. logits are already divided by temperature."""
    vocab = logits.shape[1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, _MASK).softmax(dim=1)
        # Keep a token if the mass before it is under top_p: the first token always stays.
        before = probs.cumsum(dim=1) - probs
        drop |= before >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=1)
        floor = min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, _MASK)
    return logits


class Sampler:
    """Samples one token per row. Rows are the sequences in `seqs`, in the same order."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: Seq[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (token ids [N], raw logprobs [N, V] float32 of the unprocessed logits, computed
        only when some request asked for logprobs)."""
        logits = logits.float()
        params = [s.params for s in seqs]
        want = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=1) if want else None
        if any(_penalised(p) for p in params):
            logits = apply_penalties(logits.clone(), seqs)
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        if bool(greedy.all()):
            return logits.argmax(dim=1), logprobs
        temp = torch.tensor(
            [p.temperature if not p.greedy else 1.0 for p in params], device=logits.device
        )
        scaled = logits / temp.unsqueeze(1)
        scaled = filter_logits(
            scaled,
            torch.tensor([p.top_k for p in params], device=logits.device),
            torch.tensor([p.top_p for p in params], device=logits.device),
            torch.tensor([p.min_p for p in params], device=logits.device),
        )
        probs = scaled.softmax(dim=1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. One launch for the
        # unseeded rows; seeded rows get noise that is a pure function of (seed, output index,
        # token), so neither the batch nor a preemption changes what they draw.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            dev = logits.device
            noise[torch.tensor(seeded, device=dev)] = seeded_exponential(
                torch.tensor([params[i].seed for i in seeded], dtype=torch.int64, device=dev),
                torch.tensor([seqs[i].num_output for i in seeded], dtype=torch.int64, device=dev),
                probs.shape[1],
            )
        sampled = (probs / noise).argmax(dim=1)
        return torch.where(greedy, logits.argmax(dim=1), sampled), logprobs


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch holds (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _MIX1, _MIX2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def seeded_exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Exp(1) noise, a pure function of (seed, step, token index): a
    splitmix64 hash of a counter, on the device, no generator objects (int64 products wrap)."""
    token = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = (seeds * _GOLDEN + steps * _MIX1).unsqueeze(1) + token * _MIX2
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    uniform = (_shr(x, 11).double() + 0.5) / float(1 << 53)  # in (0, 1), never 0
    return (-torch.log(uniform)).float()


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
