"""A model-free Executor for scheduler tests: a KV cache of token ids and a deterministic sampler.

Each step writes the chunk's token ids into the cache slots its block table names, then reads a
sampling sequence's whole context back through its block table. A block shared by mistake, freed
while in use or missing from the table shows up as a context that differs from the sequence's
own tokens, so every scheduler test also checks the KV bookkeeping.

It supports overlap like a device does: a PENDING input token is the one it sampled for that
sequence in the step before, which the scheduler has not been told yet.
"""

from __future__ import annotations

from inferx_core.interfaces import Executor, SchedulerOutput, StepResult
from inferx_core.sequence import PENDING, SamplingParams


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
    supports_overlap = True

    def __init__(
        self, num_kv_blocks: int, block_size: int, windows: dict[int, int] | None = None
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        # KV groups past group 0 (full): group -> its window (sliding) or 0 (full). Every
        # group's table is written; a sliding one is read back over the window only.
        self.windows = windows or {}
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_kv_blocks)]
        self.tokens_run = 0
        self.pending_inputs = 0  # PENDING tokens read from the step before
        self.last: dict[int, int] = {}  # id(seq) -> what the last step sampled for it

    def execute(self, out: SchedulerOutput) -> StepResult:
        bs = self.block_size
        last, self.last = self.last, {}

        def token(seq, pos: int) -> int:
            t = seq.token_ids[pos]
            if t == PENDING:
                assert pos == len(seq.token_ids) - 2, "a PENDING input that is not the last"
                self.pending_inputs += 1
                return last[id(seq)]
            return t

        for c in out.chunks:
            table = c.seq.block_table
            assert 0 not in table, f"{c.seq.request_id} holds the reserved block 0"
            for pos in range(c.start, c.start + c.num_tokens):
                t = token(c.seq, pos)
                for g in (0, *self.windows):
                    b = c.seq.block_tables[g][pos // bs]
                    assert b, f"{c.seq.request_id} writes group {g} into block 0"
                    self.cache[b][pos % bs] = t
            self.tokens_run += c.num_tokens
        sampled = []
        for c in out.chunks:
            if not c.sample:
                continue
            end = c.start + c.num_tokens
            seq = c.seq
            assert seq.token_ids[end] == PENDING, "a sampled position that is not PENDING"
            table = seq.block_table
            context = [self.cache[table[p // bs]][p % bs] for p in range(end)]
            want = [t if t != PENDING else last[id(seq)] for t in seq.token_ids[:end]]
            assert context == want, f"{seq.request_id} reads corrupt KV"
            for g, window in self.windows.items():
                table = seq.block_tables[g]
                first = max(0, end - window) if window else 0  # the last query's keys
                seen = [self.cache[table[p // bs]][p % bs] for p in range(first, end)]
                assert 0 not in {table[p // bs] for p in range(first, end)}, "a freed block read"
                assert seen == want[first:], f"{seq.request_id} reads corrupt group {g} KV"
            sampled.append(next_token(context))  # type: ignore[arg-type]
            self.last[id(seq)] = sampled[-1]
        return StepResult(sampled)
