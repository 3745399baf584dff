"""Prometheus metrics of the server (``GET /metrics``), named as vLLM's with this library's prefix.

Per server (one ``CollectorRegistry`` each, so that two apps in one process keep apart):

- gauges, read at each scrape: ``dynamo_once:num_requests_running`` (sequences holding cache blocks),
  ``dynamo_once:num_requests_waiting`` (submitted, not yet admitted), ``dynamo_once:kv_cache_usage_perc`` (the share of
  cache blocks sequences hold; cached prefix blocks none holds count as free, as they are evicted on demand);
- ``dynamo_once:num_preemptions_total``: running sequences preempted so far (the scheduler's count, read at each scrape);
- counters, at each request's end: ``dynamo_once:prompt_tokens_total``, ``dynamo_once:generation_tokens_total``,
  ``dynamo_once:prefix_cache_hits_total`` (prompt tokens taken from the prefix cache),
  ``dynamo_once:request_success_total{finished_reason}`` ("stop", "length", "abort");
- histograms: ``dynamo_once:e2e_request_latency_seconds`` (arrival to the final output), and for streamed requests
  ``dynamo_once:time_to_first_token_seconds`` (arrival to the first chunk with text: a request that is not streamed
  is not looked at before its end).

Needs ``prometheus_client`` (the ``serve`` extra); without it ``/metrics`` answers 501 saying so.
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.outputs import RequestOutput

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily
except ImportError:  # the route says what is missing
    prom = None

__all__ = ["ServerMetrics", "server_metrics"]

logger = logging.getLogger(__name__)

PREFIX = "dynamo_once:"
#: Seconds: from a few ms (a short answer from a small model) to minutes (long generations).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


class ServerMetrics:
    """The metrics of one server over ``llm`` (its scheduler and KV cache are read at scrape time).

    Raises:
        ImportError: without ``prometheus_client``.
    """

    def __init__(self, llm: Any, model_name: str) -> None:
        if prom is None:
            raise ImportError("the /metrics route needs prometheus_client (pip install -e '.[serve]')")
        self.registry = registry = prom.CollectorRegistry()
        labels = {"model_name": model_name}
        names = ["model_name"]
        sched, cache = llm.scheduler, llm.kv_cache

        def gauge(name: str, doc: str, read: Any) -> None:
            prom.Gauge(PREFIX + name, doc, names, registry=registry).labels(**labels).set_function(read)

        gauge("num_requests_running", "Sequences holding cache blocks.", lambda: len(sched.running))
        gauge("num_requests_waiting", "Requests submitted and not yet admitted.",
              lambda: len(sched.waiting) + llm.engine.num_incoming)
        gauge("kv_cache_usage_perc", "The share of KV-cache blocks sequences hold (0-1).",
              lambda: 1.0 - cache.num_free_blocks / cache.num_blocks)
        registry.register(_SchedulerCounter(PREFIX + "num_preemptions", "Sequences preempted (blocks freed, computed "
                                            "again later).", lambda: sched.num_preemptions, labels))

        def counter(name: str, doc: str) -> Any:
            return prom.Counter(PREFIX + name, doc, names, registry=registry).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for ended requests.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens taken from the prefix cache.")
        self._success = prom.Counter(PREFIX + "request_success", "Ended requests, by finish reason.",
                                     names + ["finished_reason"], registry=registry)
        self._labels = labels
        self.e2e = prom.Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the final output.", names,
                                  buckets=LATENCY_BUCKETS, registry=registry).labels(**labels)
        self.ttft = prom.Histogram(PREFIX + "time_to_first_token_seconds",
                                   "Arrival to the first chunk with text (streamed requests).", names,
                                   buckets=TTFT_BUCKETS, registry=registry).labels(**labels)

    def first_output(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def ended(self, out: RequestOutput, seconds: float) -> None:
        """A request's final output, ``seconds`` after its arrival."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.prefix_hits.inc(out.num_cached_tokens)
        self._success.labels(finished_reason=str(out.finish_reason), **self._labels).inc()
        self.e2e.observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The text format a Prometheus scrape reads, and its content type."""
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST


class _SchedulerCounter:
    """A counter the scheduler keeps (read at each scrape): a collector of one ``<name>_total`` sample."""

    def __init__(self, name: str, doc: str, read: Any, labels: dict[str, str]) -> None:
        self.name, self.doc, self.read, self.labels = name, doc, read, labels

    def collect(self) -> Any:
        family = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), self.read())
        yield family


def server_metrics(llm: Any, model_name: str) -> ServerMetrics | None:
    """The server's metrics; None (with a warning) without ``prometheus_client``."""
    if prom is None:
        logger.warning("prometheus_client is not installed: /metrics answers 501 (pip install -e '.[serve]')")
        return None
    return ServerMetrics(llm, model_name)
