"""Prometheus metrics under vLLM's names with an `inferx:` prefix, so existing dashboards port.

Only the event-loop thread records, so the counts are plain ints and lists rather than
prometheus_client's locked metrics: an observation per streamed token must cost well under a
microsecond at tens of thousands of tokens per second. prometheus_client does the exposition.
The scheduler's gauges and counters come from the EngineLoop's stats snapshot at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from inferx_core.engine import RequestOutput
from inferx_core.interfaces import SchedulerStats
from inferx_server.engine_loop import Submission

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class _Histogram:
    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, model: str) -> HistogramMetricFamily:
        buckets, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([model], buckets, self.sum)
        return family


class Metrics(Collector):
    """One per server (and one registry), so several servers in one process do not collide."""

    def __init__(self, model: str, stats: Callable[[], SchedulerStats]) -> None:
        self.model = model
        self.stats = stats
        self.ttft = _Histogram(
            "inferx:time_to_first_token_seconds", "Arrival to first output token.", _TTFT_BUCKETS
        )
        self.itl = _Histogram(
            "inferx:inter_token_latency_seconds", "Time between two outputs of a request.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = _Histogram(
            "inferx:e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS
        )
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0
        self.finished: dict[str, int] = {}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def on_output(self, sub: Submission, index: int, out: RequestOutput, t: float) -> None:
        if out.token_ids:
            if sub.first[index] is None:
                sub.first[index] = t
                self.ttft.observe(t - sub.arrival)
            else:
                self.itl.observe(t - sub.last[index])
            sub.last[index] = t
            self.generation_tokens += len(out.token_ids)
        if out.finished and out.finish_reason != "abort":
            self.e2e.observe(t - sub.arrival)
            self.prompt_tokens += out.num_prompt_tokens
            reason = out.finish_reason or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def on_abort(self, count: int) -> None:
        self.aborted += count

    def collect(self) -> Iterator[Metric]:
        s, model = self.stats(), [self.model]
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.running),
            ("num_requests_waiting", "Requests waiting to run.", s.waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use, 0..1.", s.kv_usage),
        ):
            gauge = GaugeMetricFamily(f"inferx:{name}", doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits),
            ("num_preemptions", "Sequences preempted.", s.preemptions),
            ("prompt_tokens", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("generation_tokens", "Generated tokens.", self.generation_tokens),
            ("num_aborted_requests", "Requests aborted: client gone, or drain timeout.",
             self.aborted),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"inferx:{name}", doc, labels=["model_name"])
            counter.add_metric(model, value)
            yield counter
        done = CounterMetricFamily(
            "inferx:request_success", "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )  # fmt: skip
        for reason, count in sorted(self.finished.items()):
            done.add_metric([self.model, reason], count)
        yield done
        for hist in (self.ttft, self.itl, self.e2e):
            yield hist.family(self.model)

    def render(self) -> bytes:
        return generate_latest(self.registry)
