"""Prometheus metrics of one app, in its own registry (two apps in a process never mix).

Counters and the TTFT histogram are updated as requests run (:class:`Metrics` is the
serving pipeline's :class:`~omlx_core.serving.ServingEvents`); engine counters, queue
depths and memory readings are read at scrape time from ``engine.stats()`` and from the
memory guard's latest limit snapshot, and a source that fails is skipped, never fatal.
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from omlx_core.serving import ServingEvents

if TYPE_CHECKING:
    from omlx_core.memory.types import RequestRejected
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics(ServingEvents):
    """What the front end counts, plus the collector that reads live values on scrape."""

    def __init__(self, context: ServerContext, in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("omlx_http_requests", "HTTP requests answered, by route and status",
                                ["route", "method", "status"], registry=registry)
        self.prompt_tokens = Counter("omlx_prompt_tokens", "prompt tokens of admitted requests",
                                     ["model"], registry=registry)
        self.cached_prompt_tokens = Counter(
            "omlx_cached_prompt_tokens", "prompt tokens served from the prefix cache",
            ["model"], registry=registry)
        self.completion_tokens = Counter("omlx_completion_tokens", "tokens generated",
                                         ["model"], registry=registry)
        self.encoded_inputs = Counter("omlx_encoded_inputs", "inputs embedded or scored "
                                      "(embeddings, rerank documents)", ["model"],
                                      registry=registry)
        self.encoded_tokens = Counter("omlx_encoded_tokens", "tokens of the inputs embedded "
                                      "or scored", ["model"], registry=registry)
        self.encode_seconds = Histogram("omlx_encode_seconds", "an embedding or rerank "
                                        "request's arrival to its answer", ["model"],
                                        buckets=TTFT_BUCKETS, registry=registry)
        self.ttft = Histogram("omlx_time_to_first_token_seconds",
                              "request arrival to first generated output", ["model"],
                              buckets=TTFT_BUCKETS, registry=registry)
        self.rejections = Counter(
            "omlx_memory_rejections", "requests a memory guard refused, by stage (preflight: "
            "can never fit, 413; admission, forward: memory short now, 503 or in-band), cause "
            "and the ceiling that binds", ["binding", "stage", "cause"], registry=registry)
        self.stream_errors = Counter("omlx_stream_errors",
                                     "errors sent in-band after a stream had started", ["model"],
                                     registry=registry)
        self.client_disconnects = Counter("omlx_client_disconnects",
                                          "requests aborted because the client hung up",
                                          registry=registry)
        registry.register(_LiveValues(context, in_flight))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- ServingEvents ----------------------------------------------------------------------

    def admitted(self, model_id: str, prompt_tokens: int, ttft_s: float) -> None:
        self.ttft.labels(model_id).observe(ttft_s)
        self.prompt_tokens.labels(model_id).inc(prompt_tokens)

    def encoded(self, model_id: str, inputs: int, tokens: int, seconds: float) -> None:
        self.encoded_inputs.labels(model_id).inc(inputs)
        self.encoded_tokens.labels(model_id).inc(tokens)
        self.encode_seconds.labels(model_id).observe(seconds)

    def rejected(self, model_id: str, error: RequestRejected) -> None:
        rejection = error.rejection
        self.rejections.labels(rejection.binding or "unknown", rejection.stage,
                               rejection.cause).inc()

    def finished(self, model_id: str, completion_tokens: int, cached_tokens: int) -> None:
        self.completion_tokens.labels(model_id).inc(completion_tokens)
        if cached_tokens:
            self.cached_prompt_tokens.labels(model_id).inc(cached_tokens)

    def disconnected(self, request_id: str) -> None:
        self.client_disconnects.inc()


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def flatten_stats(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"prefix_cache": {"hits": 3}}`` -> ``{"prefix_cache_hits": 3}``: an engine's
    nested counters as ``/metrics`` and ``/health`` show them."""
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_stats(value, name + "_"))
        else:
            flat[name] = value
    return flat


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower() or "value"


class _LiveValues(Collector):
    def __init__(self, context: ServerContext, in_flight: Callable[[], int]):
        self._context = context
        self._in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("omlx_http_requests_in_flight",
                                "generation requests being served", value=self._in_flight())
        yield from self._engine_values()
        try:
            yield from self._memory_values()
        except Exception:
            log.warning("reading the memory guard for /metrics failed", exc_info=True)
        try:
            yield from self._pool_values()
        except Exception:
            log.warning("reading the model pool for /metrics failed", exc_info=True)

    def _engine_values(self) -> Iterator[GaugeMetricFamily]:
        queue = GaugeMetricFamily("omlx_queue_depth", "requests waiting in the engine",
                                  labels=["model"])
        hits = GaugeMetricFamily("omlx_cache_hits", "prefix cache hits reported by the engine",
                                 labels=["model"])
        stats_by_name: dict[str, GaugeMetricFamily] = {}
        for model_id, engine in list(self._context.engines.items()):
            try:
                stats = flatten_stats(engine.stats() or {})
            except Exception:
                log.warning("engine.stats() of %s failed", model_id, exc_info=True)
                continue
            if (value := _number(stats.get("queue_depth"))) is not None:
                queue.add_metric([model_id], value)
            if (value := _number(stats.get("prefix_cache_hits"))) is not None:
                hits.add_metric([model_id], value)
            for key, raw in stats.items():
                value = _number(raw)
                if value is None:
                    continue
                name = "omlx_engine_" + _metric_name(str(key))
                family = stats_by_name.get(name)
                if family is None:
                    family = stats_by_name[name] = GaugeMetricFamily(
                        name, f"engine.stats()[{key!r}]", labels=["model"])
                family.add_metric([model_id], value)
        yield queue
        yield hits
        yield from stats_by_name.values()

    def _pool_values(self) -> Iterator[Any]:
        """The model pool: loads, unloads by reason (evicted, keep_alive, admin), load
        refusals by cause, load seconds, resident models and the bytes they hold."""
        pool = self._context.pool
        if pool is None:
            return
        counters = pool.counters
        yield CounterMetricFamily("omlx_model_loads", "models loaded (at start and on demand)",
                                  value=counters.loads)
        yield CounterMetricFamily("omlx_model_load_failures",
                                  "model loads that failed (missing or corrupt files, "
                                  "unsupported architecture)", value=counters.load_failures)
        unloads = CounterMetricFamily("omlx_model_unloads", "models unloaded, by reason "
                                      "(evicted: to make room for another; keep_alive: idle "
                                      "past its keep_alive; admin: asked for)", labels=["reason"])
        for reason in ("evicted", "keep_alive", "admin"):
            unloads.add_metric([reason], counters.unloads.get(reason, 0))
        yield unloads
        refusals = CounterMetricFamily("omlx_model_load_refusals", "model loads refused for "
                                       "memory, by cause (never_fits: 413; memory_short, "
                                       "queue_timeout: 503)", labels=["cause"])
        for cause, count in sorted(counters.refusals.items()):
            refusals.add_metric([cause], count)
        yield refusals
        yield SummaryMetricFamily("omlx_model_load_seconds", "seconds a model load took",
                                  count_value=counters.loads,
                                  sum_value=counters.load_seconds_total)
        records = pool.records()
        yield GaugeMetricFamily("omlx_models_resident", "models resident now",
                                value=sum(1 for r in records if r.state == "resident"))
        yield GaugeMetricFamily("omlx_models_available", "models that can be loaded",
                                value=len(records))
        yield GaugeMetricFamily("omlx_model_resident_bytes", "bytes the resident models hold "
                                "(measured at load; planned where not measured)",
                                value=pool.resident_bytes())

    def _memory_values(self) -> Iterator[GaugeMetricFamily]:
        guard = self._context.memory_guard
        if guard is None:
            return
        snapshot = guard.snapshot
        if snapshot is not None:
            ceilings = GaugeMetricFamily("omlx_memory_ceiling_bytes", "each memory ceiling",
                                         labels=["ceiling"])
            breakdown = snapshot.breakdown
            binding = breakdown.binding if breakdown is not None else None
            for name, value in (breakdown.ceilings() if breakdown is not None else {}).items():
                ceilings.add_metric([name], value)
            yield ceilings
            if snapshot.hard_bytes is not None:
                yield GaugeMetricFamily("omlx_memory_hard_limit_bytes",
                                        "the binding (smallest) ceiling", value=snapshot.hard_bytes)
            yield GaugeMetricFamily("omlx_memory_in_use_bytes", "memory in use at the last poll",
                                    value=snapshot.in_use_bytes)
            yield GaugeMetricFamily("omlx_memory_reclaimable_bytes",
                                    "of the memory in use, what the server gives back on demand "
                                    "(prefix caches, mlx's buffer cache)",
                                    value=snapshot.reclaimable_bytes)
            if snapshot.headroom_bytes is not None:
                yield GaugeMetricFamily("omlx_memory_headroom_bytes",
                                        "room a new request has now with every cache emptied",
                                        value=snapshot.headroom_bytes)
            if binding is not None:
                flag = GaugeMetricFamily("omlx_memory_binding_ceiling",
                                         "1 for the ceiling that is the hard limit",
                                         labels=["ceiling"])
                flag.add_metric([binding], 1)
                yield flag
        yield GaugeMetricFamily("omlx_admission_queue_depth", "requests waiting for memory",
                                value=guard.waiting)
        yield GaugeMetricFamily("omlx_memory_preempted_requests",
                                "requests preempted to let older ones grow, waiting to resume",
                                value=guard.admission.suspended)
        preemptions = CounterMetricFamily(
            "omlx_memory_preemptions", "requests paused for memory, to resume later (their "
            "clients see a pause, not an error), by binding ceiling and stage (decode: KV "
            "growth did not fit; forward: a prefill refused while others ran)",
            labels=["binding", "stage"])
        for (binding, stage), count in sorted(guard.preemptions().items()):
            preemptions.add_metric([binding, stage], count)
        yield preemptions
