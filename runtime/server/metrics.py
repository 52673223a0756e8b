"""``GET /metrics``: the server's Prometheus registry (see docs/http.md for every metric).

Each ``OpenAIServer`` owns a ``ServerMetrics``: a registry of its own (never prometheus-client's
global one, so two servers in one process do not clash) holding what only the HTTP layer sees
(requests by outcome, time to first token, inter-token latency, prewarms by outcome) and a
``RuntimeCollector`` that reads the runtime's counters at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter

from runtime.host.api import RuntimeStats
from runtime.messages import Cancelled, Failed, Finished, FinishReason, TokensEmitted, Usage
from runtime.server.stats_collector import RuntimeCollector

Clock = Callable[[], float]
# Local models answer in tens of milliseconds to tens of seconds (a long cold prefill).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OTHER_MODEL = "(unknown)"  # the model label of requests naming a model the server does not have
GENERATION_OUTCOMES = ("finished", "cancelled", "failed", "rejected", "disconnected")
PREWARM_OUTCOMES = ("prewarmed", "adopted", "superseded", "cancelled", "failed", "rejected")


class ServerMetrics:
    """The registry ``GET /metrics`` exposes, and the instruments the HTTP layer observes."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self, read_stats: Callable[[], RuntimeStats | None], clock: Clock = time.perf_counter
    ) -> None:
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = PromCounter(
            "mlxrt_requests",
            "Generation requests (completions and chat) by model and outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.prewarms = PromCounter(
            "mlxrt_prewarms",
            "Prewarm requests by model and outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = PromCounter(
            "mlxrt_prompt_tokens",
            "Prompt tokens of generation requests, cached ones included (from their usage).",
            ["model"],
            registry=self.registry,
        )
        self.cached_prompt_tokens = PromCounter(
            "mlxrt_cached_prompt_tokens",
            "Prompt tokens of generation requests served from the prefix cache.",
            ["model"],
            registry=self.registry,
        )
        self.completion_tokens = PromCounter(
            "mlxrt_completion_tokens",
            "Tokens generated for generation requests (from their usage).",
            ["model"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "mlxrt_time_to_first_token_seconds",
            "From the request reaching its handler to its first token.",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "mlxrt_inter_token_latency_seconds",
            "Time between tokens after the first (a gap that brought n tokens counts n times).",
            ["model"],
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(RuntimeCollector(read_stats))

    def declare_model(self, model: str) -> None:
        """Show ``model``'s request series from the start, at zero (a rate needs a first sample)."""
        for outcome in GENERATION_OUTCOMES:
            self.requests.labels(model, outcome)
        for outcome in PREWARM_OUTCOMES:
            self.prewarms.labels(model, outcome)
        for tokens in (self.prompt_tokens, self.cached_prompt_tokens, self.completion_tokens):
            tokens.labels(model)

    def exposition(self) -> bytes:
        """The whole registry in the text format (reads the runtime's stats now)."""
        return generate_latest(self.registry)

    def prewarm_ended(self, model: str, ended: Finished | Cancelled | Failed | None) -> None:
        """Count one prewarm of ``model`` by how it ended (None: the runtime refused it)."""
        self.prewarms.labels(model, _prewarm_outcome(ended)).inc()

    def stream_timer(self, model: str) -> StreamTimer:
        """A timer for one generation stream of ``model``, started now."""
        return StreamTimer(self, model)


class StreamTimer:
    """Observes one stream: its first token, the gaps between tokens, and how it ended."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self._metrics = metrics
        self._model = model
        self._last = metrics.clock()
        self._tokens_seen = False
        self._outcome_recorded = False

    def tokens_emitted(self, event: TokensEmitted) -> None:
        now = self._metrics.clock()
        gap = now - self._last
        self._last = now
        count = len(event.token_ids)
        if count == 0:
            return
        inter_token = self._metrics.inter_token_latency.labels(self._model)
        if not self._tokens_seen:
            self._tokens_seen = True
            self._metrics.time_to_first_token.labels(self._model).observe(gap)
            for _ in range(count - 1):  # they came with the first token: no wait of their own
                inter_token.observe(0.0)
            return
        for _ in range(count):
            inter_token.observe(gap / count)

    def ended(self, outcome: str, usage: Usage | None = None) -> None:
        """Count the stream once, by the first outcome reported, and its ``usage`` if it has one
        (a client that went away leaves before its request's usage comes)."""
        if self._outcome_recorded:
            return
        self._outcome_recorded = True
        self._metrics.requests.labels(self._model, outcome).inc()
        if usage is not None:
            self._metrics.prompt_tokens.labels(self._model).inc(usage.prompt_tokens)
            self._metrics.cached_prompt_tokens.labels(self._model).inc(usage.cached_prompt_tokens)
            self._metrics.completion_tokens.labels(self._model).inc(usage.completion_tokens)


def _prewarm_outcome(ended: Finished | Cancelled | Failed | None) -> str:
    match ended:
        case None:
            return "rejected"
        case Finished(reason=FinishReason.ADOPTED):
            return "adopted"
        case Finished():
            return "prewarmed"
        case Cancelled(reason="superseded"):
            return "superseded"
        case Cancelled():
            return "cancelled"
        case Failed():
            return "failed"
