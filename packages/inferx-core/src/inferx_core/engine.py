"""The engine loop: requests in, scheduler picks a step, executor runs it, outputs out.

Engine is single-threaded; LLM is the offline API on top. Detokenization and stop strings live
here, on the CPU, beside the scheduler.

With engine.overlap (and an executor that supports it) one step is always in flight: step()
schedules and submits step N+1 before it waits for step N's tokens, so the host's work (the
scheduler, building inputs, detokenizing) runs while the device computes. A sequence that stops
at step N has one step N+1 computed in vain; a step whose sequences need their tokens on the
host to sample the next one (penalties) is collected before the next is scheduled.

Structured output: a request with a JSON schema gets a GrammarState (`Grammars`: the backend
plugin, compiled schemas cached) on its Sequence; the executor queues its masks on the grammar
worker (which feeds the matcher the previous step's token first, from that step's result when it
is still in flight) and samples once they are filled; _apply finishes the request once its JSON
is complete, reading the matcher's state after the worker has published it.
"""

from __future__ import annotations

import atexit
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferx_core.config import Config, load_config
from inferx_core.grammar import Grammars, catch_up
from inferx_core.interfaces import (
    DoneStep,
    Executor,
    KVManager,
    PendingStep,
    Scheduler,
    SchedulerOutput,
    StepResult,
)
from inferx_core.plugins import Plugins, plugins
from inferx_core.sequence import SamplingParams, Sequence

log = logging.getLogger("inferx.engine")
_unfreeze_at_exit = False


def thaw_heap() -> None:
    """Undo freeze_heap and collect: what an earlier engine froze and has since been dropped
    (its weights, held by a reference cycle) is garbage the collector cannot free while frozen.
    A new engine calls this before it allocates anything."""
    gc.unfreeze()
    gc.collect()


def freeze_heap() -> None:
    """Collect the garbage, then move every live object to the collector's permanent generation
    (gc.freeze), which its collections skip. What is frozen is never collected while frozen (a
    cycle that becomes garbage stays until thaw_heap), so a process does this once its
    long-lived state is built; at exit the heap is unfrozen so that finalization frees it."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text since the last output."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class Completion:
    """A finished request, whole."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class _Request:
    seq: Sequence
    detok: Any  # IncrementalDetokenizer or FinalDetokenizer, or None without a tokenizer
    stop: Any  # StopChecker, or None without stop strings
    sent: int = 0  # output tokens already reported
    logprobs: list = field(default_factory=list)


class Engine:
    """Owns the scheduler, the KV manager and the executor for one model."""

    def __init__(
        self,
        config: Config,
        executor: Executor | None = None,
        tokenizer: Any = None,
        reg: Plugins | None = None,
    ) -> None:
        reg = reg or plugins()
        self.config = config
        if config.engine.gc_freeze:
            thaw_heap()
        if executor is None:
            from inferx_core.executor import make_executor

            executor = make_executor(config, reg)
        self.executor = executor
        self.tokenizer = (
            tokenizer if tokenizer is not None else getattr(executor, "tokenizer", None)
        )
        self.max_model_len: int = getattr(executor, "max_model_len", None) or (
            config.model.max_model_len or 4096
        )
        kv_cls = reg.get("kv_manager", config.kv_cache.manager)
        # A model of several KV groups (or a sliding one) tells the manager its groups, and the
        # most tokens a step adds to a sequence, which bounds what a sliding group holds.
        kv_args: dict[str, Any] = {}
        groups = getattr(executor, "kv_groups", None)
        if groups and (len(groups) > 1 or groups[0].kind != "full"):
            kv_args = {"groups": groups, "max_chunk": config.scheduler.prefill_chunk}
        self.kv: KVManager = kv_cls(  # type: ignore[operator]
            executor.num_kv_blocks,
            executor.block_size,
            prefix_cache=config.scheduler.prefix_cache,
            **kv_args,
        )
        sched_cls = reg.get("scheduler", config.scheduler.name)
        self.scheduler: Scheduler = sched_cls(  # type: ignore[operator]
            config.scheduler, self.kv, self.max_model_len
        )
        self.requests: dict[str, _Request] = {}
        self.grammars = Grammars(
            config.engine, reg, self.tokenizer, getattr(executor, "vocab_size", None)
        )
        # Executors are duck-typed (tests and benchmarks pass their own): no flag, no overlap.
        overlap = config.engine.overlap
        if overlap == "auto":  # see EngineSection.overlap
            overlap = getattr(getattr(executor, "device", None), "type", None) != "cpu"
        self.overlap = overlap and getattr(executor, "supports_overlap", False)
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        if config.engine.gc_freeze:
            freeze_heap()

    # -- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream_text: bool = True,
    ) -> str:
        """Queue a request; raises ValueError for a prompt that cannot run, QueueFullError when
        the waiting queue is full. stream_text=False: the caller reads only the finished
        output's text, so a request without stop strings is decoded once at the end (its
        earlier outputs carry token ids and empty text)."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = getattr(self.executor, "vocab_size", None)
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"together more than the model's context of {self.max_model_len} tokens"
            )
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        seq = Sequence(ids, params, eos_token_ids=frozenset(eos))
        if (grammar := params.grammar) is not None:
            seq.grammar = self.grammars.state(grammar[1], grammar[0])  # GrammarError: a 400
        if request_id is not None:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            seq.request_id = request_id
        detok = stop = None
        if self.tokenizer is not None:
            from inferx_core.tokenizer import FinalDetokenizer, IncrementalDetokenizer, StopChecker

            if params.stop:
                stop = StopChecker(params.stop, params.include_stop_str_in_output)
            if stream_text or stop is not None:  # stop strings are found in the streamed text
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            else:
                detok = FinalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.scheduler.add(seq)
        self.requests[seq.request_id] = _Request(seq, detok, stop)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was unknown or already done."""
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def check(self) -> None:
        """Raise what the next step would if the executor can run no more (RankFailure: a
        tensor-parallel rank is gone); the serving loops call it while idle."""
        check = getattr(self.executor, "check", None)
        if check is not None:
            check()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; report every request that produced tokens or finished. With overlap,
        the step reported is the one submitted by the call before (or by this call, at first),
        and the next one is already on the device."""
        if self._in_flight is None:
            self._in_flight = self._submit(idle_ok=False)
            if self._in_flight is None:
                return []
        out, pending = self._in_flight
        self._in_flight = None
        if self.overlap and not any(c.seq.params.needs_history for c in out.chunks if c.sample):
            self._in_flight = self._submit(idle_ok=True)
        return self._apply(out, pending.result())

    def _submit(self, idle_ok: bool) -> tuple[SchedulerOutput, PendingStep] | None:
        out = self.scheduler.schedule()
        if not out.chunks:
            # With a step in flight every running sequence may be waiting on it.
            if self.scheduler.has_work() and not idle_ok:
                raise RuntimeError("scheduler has work but scheduled nothing (a scheduler bug)")
            return None
        if self.overlap:
            return out, self.executor.submit(out)
        return out, DoneStep(self.executor.execute(out))

    def _apply(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        sampled_seqs = [c.seq for c in out.chunks if c.sample]
        if result.logprobs:
            for seq, lp in zip(sampled_seqs, result.logprobs, strict=True):
                req = self.requests.get(seq.request_id)
                if req is not None and lp is not None:
                    req.logprobs.append(lp)
        finished = self.scheduler.update(out, result.sampled)
        for seq in self._complete_grammars(sampled_seqs):  # nothing but EOS could follow
            done = seq.finished
            self.scheduler.finish(seq, "stop")  # "stop" also over a "length" of this token
            if not done:
                finished.append(seq)
        outputs = []
        for seq in dict.fromkeys(sampled_seqs + finished):  # ordered, unique
            req = self.requests.get(seq.request_id)
            if req is not None:
                outputs.append(self._output(req))
        return outputs

    @staticmethod
    def _complete_grammars(seqs: list[Sequence]) -> list[Sequence]:
        """Bring each structured sequence's matcher up to its known output (the grammar worker
        may be doing so already, for the step in flight) and wait until it has; returns those
        whose grammar is complete. A token the grammar refused (the mask allowed only what it
        accepts, so a backend's bug) ends the sequence too, with a warning."""
        live = [
            s
            for s in seqs
            if s.grammar is not None and not (s.finished and s.finish_reason != "length")
        ]
        if not live:
            return []
        catch_up(live)
        complete = []
        for seq in live:
            state = seq.grammar
            if state.refused is not None:
                log.warning("%s: the grammar refused token %d", seq.request_id, state.refused)
            if state.done:
                complete.append(seq)
        return complete

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        new = seq.outputs_from(req.sent)  # one slice, not a copy of the whole output per step
        start = req.sent
        req.sent = seq.num_output
        text = ""
        finished = seq.finished
        if req.detok is not None:
            push = req.detok.push
            # one token a step is the common case: no generator and join for it
            text = push(new[0]) if len(new) == 1 else "".join(push(t) for t in new)
            if finished:
                text += req.detok.flush()
            if req.stop is not None:
                text, hit = req.stop.feed(text)
                if hit and not finished:
                    self.scheduler.finish(seq, "stop")
                    finished = True
                elif hit:
                    seq.finish_reason = "stop"
                if finished and not hit:
                    text += req.stop.flush()
        if finished:
            self.requests.pop(seq.request_id, None)
        lps = req.logprobs[start:] if req.logprobs else None
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=new,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            num_output_tokens=seq.num_output,
            logprobs=lps,
        )


class LLM:
    """Offline generation: LLM(config).generate(prompts, params)."""

    def __init__(
        self,
        config: Config | str | Path | None = None,
        overrides: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if not isinstance(config, Config):
            config = load_config(config, overrides)
        elif overrides:
            config = load_config(None, {**_flatten(config), **overrides})
        self.engine = Engine(config, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def chat_prompt(
        self, messages: list[dict[str, Any]], reasoning_effort: str | None = None
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template (in harmony for gpt-oss: then
        give SamplingParams the format's stop_token_ids, and split the reply with its parse()),
        ready for generation."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        from inferx_core.chat_formats import harmony_format

        if (fmt := harmony_format(self.tokenizer)) is not None:
            return fmt.render(messages, reasoning_effort=reasoning_effort)
        # The template writes the special tokens itself, as transformers' tokenize=True does.
        kwargs = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion, batched; results in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts and {len(plist)} SamplingParams: give one, or one a prompt"
            )
        # A bad prompt refuses the call, and leaves none of it running.
        ids = add_all(self.engine, list(zip(prompts, plist, strict=True)), stream_text=False)
        prompt_ids = {i: self.engine.requests[i].seq.prompt_ids for i in ids}
        done: dict[str, Completion] = {}
        parts = {i: _Parts() for i in ids}
        while len(done) < len(ids):
            for o in self.engine.step():
                if o.request_id not in parts:  # someone else's request on the same engine
                    continue
                parts[o.request_id].add(o)
                if o.finished:
                    done[o.request_id] = parts[o.request_id].completion(o, prompt_ids[o.request_id])
        return [done[i] for i in ids]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they come. Other queued requests also advance."""
        rid = self.engine.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for o in self.engine.step():
                    if o.request_id == rid:
                        finished = o.finished
                        yield o
        finally:
            if not finished:
                self.engine.abort(rid)


def add_all(
    engine: Any,
    items: list[tuple[Any, SamplingParams]],
    request_ids: list[str] | None = None,
    **kwargs: Any,
) -> list[str]:
    """Add each (prompt, params) as one request of `engine`, all or none: when one is refused,
    the ones added before it are aborted and the refusal raised. Returns the request ids."""
    added: list[str] = []
    try:
        for (prompt, params), rid in zip(items, request_ids or [None] * len(items), strict=True):
            added.append(engine.add_request(prompt, params, rid, **kwargs))
    except Exception:
        for rid in added:
            engine.abort(rid)
        raise
    return added


class _Parts:
    """One request's outputs so far, as flat lists. Keeping every RequestOutput instead left
    two tracked objects a token (65,536 of each in the offline benchmark) for Python's full
    collections to walk, each walk a pause of the engine's steps."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text.append(out.text)
        self.logprobs += out.logprobs or []

    def completion(self, last: RequestOutput, prompt_ids: list[int]) -> Completion:
        return Completion(
            request_id=last.request_id,
            prompt_token_ids=prompt_ids,
            token_ids=self.token_ids,
            text="".join(self.text),
            finish_reason=last.finish_reason,
            num_cached_tokens=last.num_cached_tokens,
            logprobs=self.logprobs or None,
        )


def _flatten(config: Config) -> dict[str, Any]:
    return {
        f"{section}.{key}": value
        for section, values in config.model_dump(exclude_unset=True).items()
        for key, value in values.items()
    }
