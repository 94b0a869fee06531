"""The continuous-batching scheduler: chunked prefill mixed with decode, recompute preemption.

Each step serves the running sequences in admission order (a decode token each, or the next
prompt chunk), then admits waiting ones first come, first served while the token budget,
max_running and free blocks allow. When a running sequence needs a block and none is left, the
most recently admitted running sequence is preempted: its blocks are freed and it waits at the
front of the queue to recompute its prompt and generated tokens later.

A step may be scheduled before the previous one's results are in (the engine overlaps the two):
schedule() counts a chunk as computed at once and appends a PENDING token for each token it will
sample; update() fills those in, so the next schedule() can already run the decode of a PENDING
token (the executor takes its id from the previous step's sampled tokens on the device). A
sequence whose pending token will be its last (max_tokens or the context) is not scheduled again;
one that stops on a token found later ran one step in vain, and that step's token is dropped.
"""

from __future__ import annotations

from collections import deque

from inferx_core.config import SchedulerSection
from inferx_core.interfaces.kv import KVManager
from inferx_core.interfaces.scheduler import (
    QueueFullError,
    ScheduledChunk,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from inferx_core.sequence import PENDING, Sequence, Status


class ContinuousScheduler(Scheduler):
    """Continuous batching over one KVManager; max_model_len caps every sequence's tokens."""

    def __init__(self, config: SchedulerSection, kv: KVManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self._active: dict[str, Sequence] = {}  # request id -> waiting or running sequence
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} requests are waiting (scheduler.max_waiting); retry later"
            )
        n = seq.num_prompt
        if n == 0:
            raise ValueError(f"{seq.request_id}: the prompt is empty")
        if n > self.max_model_len:
            raise ValueError(
                f"{seq.request_id}: the prompt has {n} tokens, more than the model's context "
                f"of {self.max_model_len}"
            )
        # The last token is sampled, never run, so a sequence that ends at `final` tokens
        # stores KV for final - 1 of them.
        final = min(n + seq.params.max_tokens, max(self.max_model_len, n + 1))
        if not self.kv.fits(final - 1):
            raise ValueError(
                f"{seq.request_id}: {final} tokens need {self.kv.blocks_needed(final - 1)} KV "
                f"blocks but the cache has {self.kv.num_usable_blocks}; shorten the prompt or "
                "max_tokens, or enlarge the KV cache"
            )
        if seq.request_id in self._active:
            raise ValueError(f"request id {seq.request_id!r} is already queued or running")
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self._active[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._active.get(request_id)
        if seq is None:
            return None
        self._remove(seq)
        self._finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.finished:
            # A stop string found in the token that also hit max_tokens: the stop wins.
            if seq.finish_reason == "length":
                seq.finish_reason = reason
            return
        self._remove(seq)
        self._finish(seq, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_usage=self.kv.usage(),
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            preemptions=self._preemptions,
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        chunks = out.chunks
        budget = self.config.max_batched_tokens
        chunk_cap = self.config.prefill_chunk
        running = self.running

        max_len = self.max_model_len
        # Preemption pops from the end of `running`; the loop never reaches what was popped.
        for i, seq in enumerate(running):
            tokens = seq.token_ids
            if seq.num_pending and len(tokens) >= min(seq.max_length, max_len):
                continue  # its pending token is its last: update() will finish it
            start = seq.num_computed
            left = len(tokens) - start
            # A prompt chunk leaves one token of budget for each sequence after it, so a long
            # prompt never stalls the decodes behind it (max_running <= max_batched_tokens).
            n = 1 if left == 1 else min(left, chunk_cap, budget - (len(running) - i - 1))
            if not self._grow(seq, start + n, out):
                break  # seq was the last one and preempted itself
            chunks.append(ScheduledChunk(seq, start, n, n == left))
            seq.num_computed = start + n
            if n == left:
                tokens.append(PENDING)
                seq.num_pending += 1
            budget -= n

        # Admitting right after a preemption would only take back the blocks just freed.
        if out.preempted:
            return out
        prefix = self.config.prefix_cache
        while self.waiting and budget > 0 and len(running) < self.config.max_running:
            seq = self.waiting[0]
            cached = self.kv.match_prefix(seq) if prefix else 0
            n = min(seq.num_tokens - cached, chunk_cap, budget)
            if not self.kv.allocate(seq, cached + n):
                self.kv.free(seq)  # give back the matched prefix; try again next step
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_computed = seq.num_cached = cached
            if prefix:
                self._prefix_queries += seq.num_tokens
                self._prefix_hits += cached
            running.append(seq)
            sample = cached + n == seq.num_tokens
            chunks.append(ScheduledChunk(seq, cached, n, sample))
            seq.num_computed = cached + n
            if sample:
                seq.token_ids.append(PENDING)
                seq.num_pending += 1
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        commit = self.config.prefix_cache
        fills_block = self.kv.fills_block
        max_len = self.max_model_len
        running = Status.RUNNING
        finished: list[Sequence] = []
        k = 0
        for c in out.chunks:
            seq = c.seq
            token = PENDING
            if c.sample:
                token = sampled[k]
                k += 1
            if seq.finished:
                continue  # aborted or stopped after it was scheduled
            end = c.start + c.num_tokens
            if c.sample:
                seq.token_ids[end] = token  # first, so that a commit below sees it
                seq.num_pending -= 1
            if commit and seq.status is running and fills_block(c.start, end):
                self.kv.commit(seq)  # offer the full block to the prefix cache
            if not c.sample:
                continue
            p = seq.params
            if (token in seq.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason = "stop"
            elif end + 1 >= min(seq.max_length, max_len):
                reason = "length"
            else:
                continue
            if seq.status is Status.WAITING:  # preempted while this step was in flight
                self.waiting.remove(seq)
            self._finish(seq, reason)
            finished.append(seq)
        if k != len(sampled):
            raise ValueError(f"update got {len(sampled)} sampled tokens for {k} sampling chunks")
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

    # -- helpers -------------------------------------------------------------------------------

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Find blocks for seq, preempting from the end of running; False if seq went itself."""
        while not self.kv.allocate(seq, num_tokens):
            victim = self.running.pop()
            self.kv.free(victim)
            victim.status = Status.WAITING
            victim.num_computed = 0
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            self._preemptions += 1
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _remove(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.drop_pending()
        seq.num_computed = min(seq.num_computed, len(seq.token_ids))
        if self.config.prefix_cache:
            self.kv.commit(seq)
        self.kv.free(seq)
        self._active.pop(seq.request_id, None)
