"""Prometheus metrics of the server, named after vLLM's with a ``rapidspec:`` prefix.

Every metric lives in the server's own ``CollectorRegistry`` (no global
state), served at ``GET /metrics``. Acceptance can be read from the counters
(``rate(accepted) / rate(draft_tokens)``) or from the cumulative gauge.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rapidspec.stats import GenerationStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class ServerMetrics:
    def __init__(self, model: str, waiting, running, prefix_cache_bytes=lambda: 0) -> None:
        """``waiting()`` and ``running()`` report the queue's current counts, ``prefix_cache_bytes()`` what the
        engine's prefix cache holds."""
        self.registry = CollectorRegistry()
        self._drafted = self._accepted = 0
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.model = model
        self.requests_running = Gauge("rapidspec:num_requests_running", "Requests generating now.", **labels)
        self.requests_running.labels(model).set_function(running)
        self.requests_waiting = Gauge("rapidspec:num_requests_waiting", "Requests waiting in the queue.", **labels)
        self.requests_waiting.labels(model).set_function(waiting)
        self.prefix_cache_bytes = Gauge("rapidspec:prefix_cache_bytes", "Key/value bytes the prefix cache holds "
                                        "(in memory; its bound is --prefix-cache-gib).", **labels)
        self.prefix_cache_bytes.labels(model).set_function(prefix_cache_bytes)
        self.request_success = Counter(
            "rapidspec:request_success", "Finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry,
        )
        self.request_failure = Counter(
            "rapidspec:request_failure",
            "Requests that did not finish, by reason (bad_request, queue_full, cancelled, internal_error, "
            "unauthorized, too_large).",
            labelnames=["model_name", "reason"], registry=self.registry,
        )
        self.prompt_tokens = Counter("rapidspec:prompt_tokens", "Target prompt tokens of finished requests.", **labels)
        self.generation_tokens = Counter("rapidspec:generation_tokens", "Generated tokens.", **labels)
        self.time_to_first_token = Histogram(
            "rapidspec:time_to_first_token_seconds", "From arrival to the first generated token (queue included).",
            buckets=LATENCY_BUCKETS, **labels,
        )
        self.e2e_latency = Histogram(
            "rapidspec:e2e_request_latency_seconds", "From arrival to the last token.", buckets=LATENCY_BUCKETS, **labels
        )
        self.queue_time = Histogram(
            "rapidspec:request_queue_time_seconds", "Time spent waiting for the engine.", buckets=LATENCY_BUCKETS, **labels
        )
        self.num_drafts = Counter("rapidspec:spec_decode_num_drafts", "Draft/verify rounds.", **labels)
        self.num_draft_tokens = Counter("rapidspec:spec_decode_num_draft_tokens", "Drafted tokens.", **labels)
        self.num_accepted_tokens = Counter("rapidspec:spec_decode_num_accepted_tokens", "Accepted drafted tokens.", **labels)
        self.lookup_draft_tokens = Counter(
            "rapidspec:lookup_num_draft_tokens", "Tokens drafted by prompt lookup before the drafter joined.", **labels
        )
        self.lookup_accepted_tokens = Counter(
            "rapidspec:lookup_num_accepted_tokens", "Accepted tokens drafted by prompt lookup.", **labels
        )
        self.acceptance = Gauge(
            "rapidspec:spec_decode_draft_acceptance_rate", "Accepted / drafted tokens since the server started.", **labels
        )
        self.prefix_cache_queries = Counter(
            "rapidspec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", **labels
        )
        self.prefix_cache_hits = Counter(
            "rapidspec:prefix_cache_hits", "Prompt tokens found in the prefix cache (prefill reused).", **labels
        )
        self.prefix_cache_hit_requests = Counter(
            "rapidspec:prefix_cache_hit_requests", "Requests that reused a cached prefix.", **labels
        )
        self.kv_disk_hits = Counter(
            "rapidspec:kv_disk_cache_hits", "Prompt tokens read from the key/value blocks on disk (of the prefix "
            "cache hits).", **labels
        )

    def finished(self, stats: GenerationStats, finish_reason: str) -> None:
        model = self.model
        self.request_success.labels(model, finish_reason).inc()
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens_target)
        self.generation_tokens.labels(model).inc(stats.new_tokens)
        if stats.drafted_tokens:
            self.num_drafts.labels(model).inc(stats.rounds)
            self.num_draft_tokens.labels(model).inc(stats.drafted_tokens)
            self.num_accepted_tokens.labels(model).inc(stats.accepted_tokens)
            self._drafted += stats.drafted_tokens
            self._accepted += stats.accepted_tokens
            self.acceptance.labels(model).set(self._accepted / self._drafted)
        if stats.lookup_drafted_tokens:
            self.lookup_draft_tokens.labels(model).inc(stats.lookup_drafted_tokens)
            self.lookup_accepted_tokens.labels(model).inc(stats.lookup_accepted_tokens)
        if stats.mode != "rag":  # rag's target reads retrieved text and never uses the prefix cache
            self.prefix_cache_queries.labels(model).inc(max(0, stats.prompt_tokens_target - 1))
            self.prefix_cache_hits.labels(model).inc(stats.target_prefill_reused_tokens)
            if stats.target_prefill_reused_tokens:
                self.prefix_cache_hit_requests.labels(model).inc()
            self.kv_disk_hits.labels(model).inc(stats.target_prefill_disk_tokens)

    def failed(self, reason: str) -> None:
        self.request_failure.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
