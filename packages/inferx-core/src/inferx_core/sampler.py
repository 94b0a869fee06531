"""Turns a step's logits into tokens on the logits' own device: penalties, logit biases, grammar
masks (structured output), temperature, top-k, top-p, min-p, per-request seeds, and the logprobs
a request asked for.

Seeded requests draw from a generator seeded by (seed, output position), so a request's tokens do
not depend on what else is in the batch or on whether it was preempted and recomputed.

Nothing here makes the host wait for the device: every branch is decided from the rows'
`SamplingParams`, per-row parameters reach the device in one float and one int copy (pinned and
non-blocking on CUDA), and the results stay on the device until the caller copies them back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from inferx_core.batch import to_device, to_host
from inferx_core.grammar import GrammarMasks, grammar_masks
from inferx_core.sequence import Sequence

_MASK = float("-inf")


def output_index(seq: Sequence) -> int:
    """The output position of the token a row samples now: the sequence's last token, PENDING
    (the scheduler appends it when it schedules the step)."""
    return len(seq.token_ids) - 1 - seq.num_prompt


@dataclass
class TopLogprobs:
    """The logprobs the rows asked for, under the raw (unprocessed) logits. K is the most
    alternatives any row asked for (may be 0); a row that asked for k reads the first k.

    sampled: [N] float32, the logprob of each row's sampled token.
    ids: [N, K] int64, the K most likely tokens of each row, most likely first (as topk gives).
    values: [N, K] float32, their logprobs.
    """

    sampled: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor

    def copy_to_host(self) -> TopLogprobs:
        """Starts the device-to-host copies and returns the host tensors; from CUDA they are
        valid once the stream has passed this point (synchronize or wait on an event)."""
        return TopLogprobs(to_host(self.sampled), to_host(self.ids), to_host(self.values))

    def rows(self, ks: list[int | None]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per row, None where k is None, else (sampled logprob, [(token, logprob)] of the k
        most likely tokens). Reads host tensors (see copy_to_host)."""
        sampled, ids, values = self.sampled.tolist(), self.ids.tolist(), self.values.tolist()
        return [
            None if k is None else (sampled[i], list(zip(ids[i][:k], values[i][:k], strict=True)))
            for i, k in enumerate(ks)
        ]


def apply_penalties(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Repetition (over prompt and output, Hugging Face's rule), presence and frequency (over
    output, OpenAI's rule) penalties, in place, for the rows that asked. The (row, token) pairs
    are gathered on the host (output counts too) and applied in one gather and one scatter per
    kind, from one int and one float copy."""
    rep_rows: list[int] = []
    rep_toks: list[int] = []
    rep_vals: list[float] = []
    out_rows: list[int] = []
    out_toks: list[int] = []
    out_vals: list[float] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            toks = set(seq.known_ids)
            rep_rows += [i] * len(toks)
            rep_toks += toks
            rep_vals += [p.repetition_penalty] * len(toks)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output:
            counts = Counter(seq.output_ids)
            out_rows += [i] * len(counts)
            out_toks += counts.keys()
            out_vals += [p.frequency_penalty * c + p.presence_penalty for c in counts.values()]
    if not rep_rows and not out_rows:
        return logits
    dev = logits.device
    ints = to_device(torch.tensor(rep_rows + rep_toks + out_rows + out_toks), dev)
    floats = to_device(torch.tensor(rep_vals + out_vals, dtype=torch.float32), dev)
    r, o = len(rep_rows), len(out_rows)
    if r:
        pair = (ints[:r], ints[r : 2 * r])
        picked, penalty = logits[pair], floats[:r]
        logits.index_put_(pair, torch.where(picked > 0, picked / penalty, picked * penalty))
    if o:
        pair = (ints[2 * r : 2 * r + o], ints[2 * r + o :])
        logits.index_put_(pair, logits[pair] - floats[r:])
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Add each row's logit_bias to its logits, in place, for the rows that have one: the
    (row, token) pairs in one int copy, the biases in one float copy, one scatter-add."""
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, seq in enumerate(seqs):
        for tok, bias in seq.params.logit_bias:
            rows.append(i)
            toks.append(tok)
            vals.append(bias)
    if not rows:
        return logits
    dev = logits.device
    ints = to_device(torch.tensor(rows + toks), dev)
    floats = to_device(torch.tensor(vals, dtype=torch.float32), dev)
    n = len(rows)
    logits.index_put_((ints[:n], ints[n:]), floats, accumulate=True)
    return logits


def apply_grammar(
    logits: torch.Tensor, seqs: Seq[Sequence], masks: GrammarMasks | None = None
) -> torch.Tensor:
    """Mask, in place, the tokens each structured row's grammar does not allow next. `masks`:
    the step's masks as the executor queued them (inferx_core.grammar); without, they are
    queued here, with no step in flight (the rows' output is known on the host). The masks are
    one int32 bitmask of ceil(vocab / 32) words a row (all ones for unconstrained rows, and for
    rows whose grammar is done: their token is dropped), which goes over in one copy and is
    unpacked on the device into a boolean mask."""
    n, vocab = logits.shape
    if masks is None:
        masks = grammar_masks(seqs, None, vocab, pin=logits.device.type == "cuda")
        if masks is None:
            return logits
    host = masks.wait()
    if host is None:
        return logits
    # Read as bytes (little-endian: token t is bit t % 8 of byte t // 8), the unpacked mask
    # is [rows, vocab] of one byte, not of int32.
    octets = to_device(host, logits.device).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    barred = (((octets.unsqueeze(2) >> shifts) & 1) == 0).view(n, -1)[:, :vocab]
    return logits.masked_fill_(barred, _MASK)


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    ranked: bool = True,
    floored: bool = True,
) -> torch.Tensor:
    """Mask tokens outside top-k (0 = off), outside the top-p nucleus, and below min_p times the
    most likely token's probability. logits are already divided by temperature. `ranked` and
    `floored` say, from the host, whether any row uses top-k / top-p and min-p: the filter is
    skipped when not, so no tensor value decides a branch."""
    vocab = logits.shape[1]
    if ranked:
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
    if floored:
        probs = logits.softmax(dim=1)
        floor = min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, _MASK)
    return logits


def top_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> TopLogprobs:
    """The sampled tokens' logprobs and the k most likely tokens of each row of `raw` (float32
    logits [N, V], unprocessed), as logits minus their logsumexp: no [N, V] log-softmax."""
    lse = torch.logsumexp(raw, dim=1, keepdim=True)
    best = raw.topk(k, dim=1)
    sampled = raw.gather(1, tokens.unsqueeze(1)) - lse
    return TopLogprobs(sampled.squeeze(1), best.indices, best.values - lse)


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=1)


class Sampler:
    """Samples one token per row. Rows are the sequences in `seqs`, in the same order."""

    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """argmax: [rows, vocab] -> the first index of each row's maximum (KernelOps.argmax);
        torch's argmax by default."""
        self.device = device
        self.argmax = argmax or _torch_argmax
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: Seq[Sequence],
        masks: GrammarMasks | None = None,
        out_index: list[int] | None = None,
    ) -> tuple[torch.Tensor, TopLogprobs | None]:
        """Returns (token ids [N], the requested logprobs of the unprocessed logits, or None
        when no row asked), both on the logits' device. Logits of any float dtype: all-greedy
        steps without penalties or logprobs take the argmax of them as they are (upcasting is
        exact, so it is the same token); everything else computes in float32. `masks`: the
        structured rows' grammar masks as the executor queued them (see apply_grammar).
        `out_index`: each row's output_index when the step was submitted (a step sampled
        later, once the next one is scheduled), for the seeded rows' noise."""
        params = [s.params for s in seqs]
        grammar = any(s.grammar is not None for s in seqs)
        plain = not grammar and not any(p.needs_history or p.logit_bias for p in params)
        if plain and all(p.greedy and p.logprobs is None for p in params):
            return self.argmax(logits), None
        raw = logits.float()
        ks = [p.logprobs for p in params if p.logprobs is not None]
        # Logprobs are of the raw logits; penalties, biases and grammars change a copy, which
        # the upcast already is unless logits were float32 (the caller's, left as they are).
        logits = raw if plain or (raw is not logits and not ks) else raw.clone()
        if any(p.needs_history for p in params):
            logits = apply_penalties(logits, seqs)
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, seqs)
        if grammar:
            logits = apply_grammar(logits, seqs, masks)
        tokens = self._draw(logits, seqs, out_index)
        return tokens, top_logprobs(raw, tokens, max(ks)) if ks else None

    def _draw(
        self, logits: torch.Tensor, seqs: Seq[Sequence], out_index: list[int] | None = None
    ) -> torch.Tensor:
        """Token ids [N]: argmax for greedy rows, an exponential race over the filtered
        distribution for the rest."""
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return self.argmax(logits)
        n, dev = len(params), logits.device
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        floats = torch.tensor(
            [p.temperature if not p.greedy else 1.0 for p in params]
            + [p.top_p for p in params]
            + [p.min_p for p in params],
            dtype=torch.float32,
        )
        ints = torch.tensor(
            [p.top_k for p in params]
            + [p.greedy for p in params]
            + seeded
            + [params[i].seed for i in seeded]
            + [output_index(seqs[i]) if out_index is None else out_index[i] for i in seeded],
            dtype=torch.int64,
        )
        floats, ints = to_device(floats, dev), to_device(ints, dev)
        temp, top_p, min_p = floats.view(3, n).unbind()
        top_k, greedy = ints[:n], ints[n : 2 * n] != 0
        drawn = [p for p in params if not p.greedy]
        scaled = filter_logits(
            logits / temp.unsqueeze(1),
            top_k,
            top_p,
            min_p,
            ranked=any(p.top_k > 0 or p.top_p < 1 for p in drawn),
            floored=any(p.min_p > 0 for p in drawn),
        )
        probs = scaled.softmax(dim=1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. One launch for the
        # unseeded rows; seeded rows get noise that is a pure function of (seed, output index,
        # token), so neither the batch nor a preemption changes what they draw.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        if seeded:
            s = len(seeded)
            rows, seeds, steps = ints[2 * n :].view(3, s).unbind()
            noise[rows] = seeded_exponential(seeds, steps, probs.shape[1])
        sampled = self.argmax(probs / noise)
        if len(drawn) == n:
            return sampled
        return torch.where(greedy, self.argmax(logits), sampled)


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
