"""A model-free Executor for scheduler tests: a KV cache of token ids and a deterministic sampler.

Each step writes the chunk's token ids into the cache slots its block table names, then reads a
sampling sequence's whole context back through its block table. A block shared by mistake, freed
while in use or missing from the table shows up as a context that differs from the sequence's
own tokens, so every scheduler test also checks the KV bookkeeping.
"""

from __future__ import annotations

from inferx_core.interfaces import Executor, SchedulerOutput, StepResult
from inferx_core.sequence import SamplingParams


def next_token(context: list[int]) -> int:
    """The "model": a function of the last four tokens, in 3..1002."""
    h = 0
    for t in context[-4:]:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % 1000 + 3


def expected_output(
    prompt: list[int], params: SamplingParams, eos: frozenset[int], max_model_len: int
) -> list[int]:
    """What a correct scheduler must produce for a request, computed without one."""
    tokens = list(prompt)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        if (t in eos and not params.ignore_eos) or t in params.stop_token_ids:
            break
        if len(tokens) - len(prompt) >= params.max_tokens or len(tokens) >= max_model_len:
            break
    return tokens[len(prompt) :]


class FakeExecutor(Executor):
    def __init__(self, num_kv_blocks: int, block_size: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_kv_blocks)]
        self.tokens_run = 0

    def execute(self, out: SchedulerOutput) -> StepResult:
        bs = self.block_size
        for c in out.chunks:
            table = c.seq.block_table
            assert 0 not in table, f"{c.seq.request_id} holds the reserved block 0"
            for pos in range(c.start, c.start + c.num_tokens):
                self.cache[table[pos // bs]][pos % bs] = c.seq.token_ids[pos]
            self.tokens_run += c.num_tokens
        sampled = []
        for c in out.chunks:
            if not c.sample:
                continue
            end = c.start + c.num_tokens
            table = c.seq.block_table
            context = [self.cache[table[p // bs]][p % bs] for p in range(end)]
            assert context == c.seq.token_ids[:end], f"{c.seq.request_id} reads corrupt KV"
            sampled.append(next_token(context))  # type: ignore[arg-type]
        return StepResult(sampled)
