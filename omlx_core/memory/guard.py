"""The memory guard as the serving pipeline sees it: two calls before any response byte.

:meth:`MemoryGuard.preflight` refuses a request that can never fit
(:class:`~omlx_core.memory.types.RequestRejected`, stage ``"preflight"``: HTTP 413);
:meth:`MemoryGuard.admit` waits until a request that fits alone also fits next to the
running ones, or refuses it (stage ``"admission"``: HTTP 503). The returned ticket is
released when the request ends. The guard also owns the enforcer thread and hands each
engine's scheduler one forward gate (stage ``"forward"``).

Engines describe how they allocate through :class:`~omlx_core.engine.MemoryHints`
(:meth:`~omlx_core.engine.GuardedEngine.memory_hints`); an engine the operator let run
unguarded is costed with :func:`~omlx_core.engine.assumed_hints`.

Two rules hold at every stage:

- **memory the server can give back is available memory.** Prefix caches
  (:meth:`~omlx_core.engine.GuardedEngine.reclaimable_bytes`) and mlx's buffer cache
  are not counted as in use: the idle baseline preflight and admission sit on excludes
  them, and the forward gate evicts them (least recently used first) before it refuses
  a chunk. So a 413 means "cannot fit here even with every cache emptied".
- **one transient margin** (``memory.transient_margin``, at least
  ``memory.transient_margin_share`` of the hard limit: :meth:`TierPolicy.margin`) is
  charged on top of the estimate by preflight, by admission and by the forward gate
  alike, so a request that passes preflight on an idle server is not refused half-way
  for want of it.

And preflight, which runs on the request thread, reads no memory there: it judges
against the enforcer's last published snapshot (memory is read on the enforcer's
thread and the MLX thread, through :mod:`omlx_core.platform.backend`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from omlx_core.engine import GuardedEngine, memory_hints_of
from omlx_core.memory.admission import AdmissionQueue, AdmissionTicket
from omlx_core.memory.ceilings import ProbeReadings, TierPolicy
from omlx_core.memory.enforcer import MemoryEnforcer
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.types import (
    LimitSnapshot,
    PeakEstimate,
    PeakQuery,
    PreflightRequest,
    Rejection,
    RequestRejected,
)
from omlx_core.memory.usage import MemoryUsage
from omlx_core.mlx_thread import mlx_thread
from omlx_core.platform.backend import cache_bytes, clear_cache, limit_cache, mlx_backend
from omlx_core.settings import format_size

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.engine import Engine
    from omlx_core.pluginmanager import PluginManager

log = logging.getLogger(__name__)


class MemoryGuard:
    """Estimate and rejection through the plugin hooks, budget admission
    (:mod:`.admission`), a forward gate per engine (:mod:`.forward_gate`), limits kept
    fresh by the :mod:`.enforcer`.

    :param plugins: the plugin manager whose ``estimate_peak``, ``preflight``,
        ``on_rejection`` and ``resolve_scheduler`` hooks are called.
    :param config: the effective configuration (``[memory]``).
    :param usage: where current use is read (tests pass fake readers).
    :param mlx_cache: reads the bytes in mlx's buffer cache (tests pass a fake reader).
    """

    def __init__(self, plugins: PluginManager, config: Config, *,
                 usage: MemoryUsage | None = None,
                 mlx_cache: Callable[[], int] | None = None):
        self._mlx_cache = mlx_cache or cache_bytes
        self.plugins = plugins
        self.config = config
        self.policy = TierPolicy.from_config(config)
        poll = float(config["memory.poll_interval_s"])
        self.usage = usage or MemoryUsage(window_s=2 * poll)
        #: the margin's floor; :meth:`margin` is what a decision charges
        self.transient_margin = int(config["memory.transient_margin"])
        #: completion tokens of KV a request reserves at admission; decode grows it in
        #: blocks past that, preempting the youngest request when it cannot
        self.decode_reserve_tokens = int(config["memory.decode_reserve_tokens"])
        #: a memory shortage read now has aged out of the high-water window by then
        self.retry_after_s = 2 * poll
        self.admission = AdmissionQueue(int(config["memory.queue_size"]),
                                        float(config["memory.queue_timeout_s"]),
                                        self.policy.admit_watermark,
                                        margin_bytes=self.policy.margin,
                                        on_idle=self._refresh_baseline)
        self.backend = mlx_backend()
        self.enforcer: MemoryEnforcer | None = None
        self._engines: Callable[[], Iterable[Engine]] = tuple
        self.reclaimed_bytes_total = 0
        self._mlx_cache_limit: int | None = None
        self._snapshot: LimitSnapshot | None = None
        #: the latest snapshot admission and the forward gates judge by (``adjust_limits``)
        self.judged: LimitSnapshot | None = None
        #: notified on every published snapshot (preflight may wait for a fresh baseline)
        self._published = threading.Condition()
        self._gates: dict[int, tuple[Engine, PrefillForwardGate]] = {}
        self._warned: set[str] = set()

    # -- limits ------------------------------------------------------------------------

    @property
    def snapshot(self) -> LimitSnapshot | None:
        """The latest published limits (one immutable object; read it once per decision),
        its baseline counting the model loads and unloads since it was read."""
        return self.admission.adjusted(self._snapshot)

    def update(self, snapshot: LimitSnapshot) -> LimitSnapshot:
        """A measured snapshot: preflight and the reports read it; admission (and the
        engines the enforcer publishes to next) get the one to judge by, which the
        ``adjust_limits`` hook may tighten (returned)."""
        judged = self.judged_limits(snapshot)
        with self._published:
            self._snapshot = snapshot
            self.judged = judged
            self._published.notify_all()
        self.admission.update(judged)
        if snapshot.hard_bytes is not None and snapshot.margin_bytes > 0:
            # Buffers mlx frees are kept for reuse; under a limit, at most a share of
            # the margin, so that its cache never takes the process over the limit.
            self._limit_mlx_cache(self.policy.buffer_cache_cap(snapshot.margin_bytes))
        return judged

    def _limit_mlx_cache(self, nbytes: int) -> None:
        """Cap mlx's buffer cache at ``nbytes``, on the MLX thread and only when the cap
        changes. Called from the enforcer's thread, ``mx.set_cache_limit`` would wait for
        an ``mx.eval`` under way while holding the GIL: behind a collective whose peer
        hangs, that froze every Python thread, the watchdog that ends the requests too."""
        if nbytes == self._mlx_cache_limit:
            return
        self._mlx_cache_limit = nbytes
        mlx_thread().submit(limit_cache, nbytes)

    def judged_limits(self, snapshot: LimitSnapshot) -> LimitSnapshot:
        """The ``adjust_limits`` answer for ``snapshot`` (``snapshot`` itself when no
        plugin adjusts it). A plugin that fails is logged, and the measured limits hold."""
        try:
            judged = self.plugins.hook.adjust_limits(snapshot=snapshot)
        except Exception:
            log.exception("an adjust_limits plugin failed; judging by this process's own limits")
            return snapshot
        if judged is None:
            return snapshot
        if not isinstance(judged, LimitSnapshot):
            log.error("an adjust_limits plugin answered %s, not a LimitSnapshot; judging by "
                      "this process's own limits", type(judged).__name__)
            return snapshot
        return judged

    def fresh_snapshot(self) -> LimitSnapshot | None:
        """A snapshot whose memory was read after this call (the settle barrier of a
        model load or unload): the recent high-water mark is dropped, and the enforcer
        polls twice, so a poll already under way when this was called does not count."""
        enforcer = self.enforcer
        if enforcer is None or not enforcer.running:
            return self.snapshot
        self.usage.forget_recent()
        for _ in range(2):
            with self._published:
                sequence = self._snapshot.sequence if self._snapshot is not None else 0
            enforcer.poll_soon()
            with self._published:
                self._published.wait_for(
                    lambda: self._snapshot is not None and self._snapshot.sequence > sequence,
                    timeout=self.retry_after_s + 5.0)
        return self.snapshot

    def forget(self, engine: Engine) -> None:
        """Drop what the guard keeps of an unloaded engine (its forward gate), so that
        the engine's memory can go."""
        self._gates.pop(id(engine), None)
        if self.enforcer is not None:
            self.enforcer.forget(engine)

    def idle(self) -> bool:
        return self.admission.idle()

    def quiet(self) -> bool:
        """No request runs or waits and no model is loading or unloading: what the
        process holds now is the baseline."""
        return self.admission.idle() and not self.admission.changing()

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    def start(self, engines: Callable[[], Iterable[Engine]], *,
              read: Callable[[], ProbeReadings] | None = None) -> MemoryEnforcer:
        """Start the enforcer over ``engines`` (re-listed on every poll)."""
        self._engines = engines
        if self.enforcer is None:
            kwargs = {"read": read} if read is not None else {}
            self.enforcer = MemoryEnforcer(
                engines, lambda engine: self.plugins.hook.resolve_scheduler(engine=engine),
                self.policy, float(self.config["memory.poll_interval_s"]), usage=self.usage,
                idle=self.quiet, publish=self.update, gate_for=self.forward_gate_for,
                reclaimable=self.reclaimable_bytes,
                epoch=lambda: self.admission.finished_total, **kwargs)
            self.enforcer.start()
        return self.enforcer

    def close(self) -> None:
        if self.enforcer is not None:
            self.enforcer.stop()
            self.enforcer = None

    # -- what the server can give back ---------------------------------------------------

    def reclaimable_bytes(self) -> int:
        """Memory held only to go faster: every guarded engine's caches, mlx's buffer
        cache (freed buffers kept for reuse), idle helper processes (grammar compile
        workers waiting for work) and compiled grammars."""
        total = self._mlx_cache() + self.usage.reclaimable_outside_engines()
        for engine in list(self._engines()):
            if isinstance(engine, GuardedEngine):
                total += max(0, int(engine.reclaimable_bytes()))
        return total

    def reclaim(self, nbytes: int) -> int:
        """Free at least ``nbytes`` if the caches hold that much: engines' caches first
        (least recently used blocks), then mlx's buffer cache (always emptied), then,
        only if still short, what lives beside the engines (idle grammar workers, whose
        restart costs a second of CPU, and compiled grammars). Returns the bytes freed;
        afterwards the usage reading starts afresh (the memory given back is gone, not
        a moment ago's peak). Runs on the MLX thread (the forward gate calls it)."""
        freed = 0
        for engine in list(self._engines()):
            if freed >= nbytes:
                break
            if isinstance(engine, GuardedEngine):
                freed += max(0, int(engine.reclaim(nbytes - freed)))
        cached = self._mlx_cache()
        clear_cache()
        freed += cached
        if freed < nbytes:
            freed += self.usage.reclaim_outside_engines()
        self.usage.forget_recent()
        self.reclaimed_bytes_total += freed
        log.info("reclaimed %s of caches for a request that needed the room", format_size(freed))
        return freed

    # -- estimates ---------------------------------------------------------------------

    def peak_query(self, engine: Engine, prompt_tokens: Sequence[int],
                   extra_tokens: int = 0, images: int = 0, salted: bool = False) -> PeakQuery:
        """The ``estimate_peak`` question for prefilling ``prompt_tokens`` on ``engine``,
        plus ``extra_tokens`` of KV (the completion) where admission reserves it, after
        encoding ``images`` images into the prompt's embeddings. A ``salted`` request
        (``cache_salt``) is costed as if nothing were cached: the engine's count is of
        unsalted entries, which it will not reuse."""
        hints = memory_hints_of(engine)
        cached = 0 if salted else min(int(engine.cached_tokens(prompt_tokens)),
                                      max(0, len(prompt_tokens) - 1))
        return PeakQuery(
            model_config=dict(engine.model.config),
            new_tokens=len(prompt_tokens) - cached + extra_tokens, cached_tokens=cached,
            chunk_size=hints.prefill_step_size, dtype_bytes=hints.activation_dtype_bytes,
            full_logits=hints.prefill_full_logits, model_id=engine.model.id,
            cached_kv_resident=hints.cached_kv_resident, backend=self.backend,
            images=images, kv_bits=hints.kv_bits, kv_group_size=hints.kv_group_size)

    def estimate(self, query: PeakQuery) -> PeakEstimate | None:
        """The ``estimate_peak`` answer for ``query`` (``None``: no plugin covers the model,
        warned once per model)."""
        result = self.plugins.hook.estimate_peak(query=query)
        if result is None:
            if query.model_id not in self._warned:
                self._warned.add(query.model_id)
                log.warning("no estimate_peak plugin can estimate model %r (model_type %r): its "
                            "requests are not checked against memory; enable the built-in "
                            "'estimator' plugin or install one for this architecture",
                            query.model_id, query.model_config.get("model_type"))
            return None
        if not isinstance(result, PeakEstimate):
            raise TypeError(f"an estimate_peak plugin answered {type(result).__name__} "
                            f"{result!r} for model {query.model_id!r}; it must return an "
                            "omlx_core.memory.types.PeakEstimate (or None)")
        return result

    def advice(self, rejection: Rejection) -> list[str]:
        """Advice from every ``on_rejection`` implementation, in hook order."""
        try:
            results = self.plugins.hook.on_rejection(rejection=rejection)
        except Exception:
            log.exception("an on_rejection plugin failed; the rejection goes out without advice")
            return []
        return [str(text) for text in (results or []) if text]

    def advised(self, error: RequestRejected) -> RequestRejected:
        """``error`` with the ``on_rejection`` advice, unless it already carries some."""
        return error if error.advice else error.with_advice(self.advice(error.rejection))

    # -- the stages before the first byte -----------------------------------------------

    def preflight(self, engine: Engine, request_id: str, prompt_tokens: Sequence[int], *,
                  max_tokens: int = 0, images: int = 0, salted: bool = False) -> None:
        """Raise :class:`RequestRejected` (stage ``"preflight"``) if the request can never
        fit: its prefill (after encoding its ``images``), or the KV of its prompt and
        ``max_tokens`` completion tokens."""
        snapshot = self._preflight_limits()
        query = self.peak_query(engine, prompt_tokens, images=images, salted=salted)
        try:
            self._preflight(query, request_id, snapshot, max_tokens)
        except RequestRejected as error:
            fitting = fitting_kv_bits(
                query, lambda narrower: self._preflight(narrower, request_id, snapshot, max_tokens))
            if fitting is not None:
                error = RequestRejected(dataclasses.replace(error.rejection, fitting_kv_bits=fitting))
            refused = self.advised(error)
            _log_refusal(refused)
            raise refused from None

    def _preflight(self, query: PeakQuery, request_id: str, snapshot: LimitSnapshot | None,
                   max_tokens: int) -> None:
        """The ``preflight`` hooks' word on ``query`` (raises :class:`RequestRejected`)."""
        estimate = self.estimate(query)
        # The completion's KV is checked only when one is asked for.
        per_token = estimate.kv_bytes_per_token if estimate is not None and max_tokens else 0
        self.plugins.hook.preflight(request=PreflightRequest(
            request_id=request_id, model_id=query.model_id, prompt_tokens=query.new_tokens
            + query.cached_tokens, cached_tokens=query.cached_tokens, chunk_size=query.chunk_size,
            estimated_bytes=estimate.total if estimate is not None else None, limits=snapshot,
            model_config=query.model_config,
            margin_bytes=self.policy.margin(snapshot.hard_bytes if snapshot else None),
            max_tokens=max_tokens, kv_bytes_per_token=per_token))

    def _preflight_limits(self) -> LimitSnapshot | None:
        """The snapshot preflight judges against. It runs on the request thread, so it
        reads no memory itself: on an idle server whose published baseline was read
        before the last request finished (what that request left behind may be missing:
        a stale, lower baseline would let through a request the forward gate, which
        reads current use, then refuses half-way), it asks the enforcer for a poll and
        waits for that snapshot (a poll takes milliseconds; the last request's release
        already asked for it, so the wait is usually over before it starts)."""
        enforcer = self.enforcer
        with self._published:
            snapshot = self._snapshot
        if (snapshot is None or enforcer is None or not enforcer.running
                or not self.quiet()
                or snapshot.baseline_epoch >= self.admission.finished_total):
            return self.admission.adjusted(snapshot)
        epoch = self.admission.finished_total
        enforcer.poll_soon()
        with self._published:
            self._published.wait_for(lambda: self._snapshot.baseline_epoch >= epoch
                                     or not self.quiet(), timeout=self.retry_after_s)
            snapshot = self._snapshot
        return self.admission.adjusted(snapshot)

    def _refresh_baseline(self) -> None:
        """The last running request finished: have the idle baseline read again."""
        if self.enforcer is not None:
            self.enforcer.poll_soon()

    def admit(self, engine: Engine, request_id: str, prompt_tokens: Sequence[int], *,
              max_tokens: int, images: int = 0, salted: bool = False) -> AdmissionTicket:
        """Block until the request fits next to the running ones; see :mod:`.admission`.

        The reservation covers the prompt's prefill and the KV of its first
        ``memory.decode_reserve_tokens`` completion tokens; the forward gate grows it as
        decode goes on. Requests of one engine share its padded decode batch when its
        hints say so. Raises :class:`RequestRejected` (stage ``"admission"``).
        """
        hints = memory_hints_of(engine)
        soon = min(max_tokens, self.decode_reserve_tokens)
        estimate = self.estimate(self.peak_query(engine, prompt_tokens, extra_tokens=soon,
                                                 images=images, salted=salted))
        reserve = estimate.total if estimate is not None else 0
        decode = min(reserve, estimate.kv_bytes_per_token * soon) if estimate is not None else 0
        batch = id(engine) if hints.decode_batch_padded else None
        try:
            return self.admission.admit(request_id, reserve, batch,
                                        model_id=engine.model.id, prompt_tokens=len(prompt_tokens),
                                        decode_bytes=decode, max_tokens=soon,
                                        kv_tokens=len(prompt_tokens) + soon,
                                        kv_tokens_cap=len(prompt_tokens) + max_tokens)
        except RequestRejected as error:
            refused = self.advised(error)
            _log_refusal(refused)
            raise refused from None

    # -- encode requests (embeddings, relevance scores) ----------------------------------

    def encode_query(self, engine: Engine, rows: int, width: int) -> PeakQuery:
        """The ``estimate_peak`` question for one encode forward of ``rows`` inputs padded
        to ``width`` tokens on ``engine``."""
        hints = memory_hints_of(engine)
        return PeakQuery(model_config=dict(engine.model.config), new_tokens=width,
                         chunk_size=width, dtype_bytes=hints.activation_dtype_bytes,
                         full_logits=False, model_id=engine.model.id, first_token=False,
                         backend=self.backend, encode=True, rows=rows)

    def preflight_encode(self, engine: Engine, request_id: str, longest: int) -> None:
        """Raise :class:`RequestRejected` (stage ``"preflight"``) if the request's longest
        input can never be encoded here, even alone in a forward: the engine can always
        split a batch down to that, never further."""
        snapshot = self._preflight_limits()
        query = self.encode_query(engine, 1, longest)
        estimate = self.estimate(query)
        request = PreflightRequest(
            request_id=request_id, model_id=engine.model.id, prompt_tokens=longest,
            cached_tokens=0, chunk_size=longest,
            estimated_bytes=estimate.total if estimate is not None else None, limits=snapshot,
            model_config=query.model_config,
            margin_bytes=self.policy.margin(snapshot.hard_bytes if snapshot else None))
        try:
            self.plugins.hook.preflight(request=request)
        except RequestRejected as error:
            raise self.advised(error) from None

    def admit_encode(self, engine: Engine, request_id: str, rows: int, width: int,
                     tokens: int) -> AdmissionTicket:
        """Block until the request's largest forward (``rows`` x ``width``) fits next to
        the running requests; nothing grows after it. Raises :class:`RequestRejected`
        (stage ``"admission"``)."""
        estimate = self.estimate(self.encode_query(engine, rows, width))
        reserve = estimate.total if estimate is not None else 0
        try:
            return self.admission.admit(request_id, reserve, None, model_id=engine.model.id,
                                        prompt_tokens=tokens)
        except RequestRejected as error:
            raise self.advised(error) from None

    def forward_gate_for(self, engine: Engine) -> PrefillForwardGate:
        """The forward gate installed in ``engine``'s scheduler (one per engine)."""
        entry = self._gates.get(id(engine))
        if entry is None or entry[0] is not engine:
            hints = memory_hints_of(engine)
            gate = PrefillForwardGate(
                self.estimate, self.usage, self.policy.margin, self.advice,
                dtype_bytes=hints.activation_dtype_bytes,
                full_logits=hints.prefill_full_logits, backend=self.backend,
                kv_bits=hints.kv_bits, kv_group_size=hints.kv_group_size,
                retry_after_s=self.retry_after_s, reclaim=self.reclaim,
                ledger=self.admission)
            entry = self._gates[id(engine)] = (engine, gate)
        return entry[1]

    def refused_total(self) -> int:
        """Forward-gate refusals (final ones) over every engine."""
        return sum(gate.refused_total for _engine, gate in self._gates.values())

    def preempted_total(self) -> int:
        """Requests preempted (to resume later) over every engine."""
        return sum(gate.preempted_total for _engine, gate in self._gates.values())

    def preemptions(self) -> dict[tuple[str, str], int]:
        """Preemptions over every engine by (binding ceiling, stage)."""
        totals: dict[tuple[str, str], int] = {}
        for _engine, gate in self._gates.values():
            for key, count in gate.preemptions.items():
                totals[key] = totals.get(key, 0) + count
        return totals


def fitting_kv_bits(query: PeakQuery, preflight: Callable[[PeakQuery], None]) -> int | None:
    """The widest quantized KV format, narrower than ``query``'s, under which the refused
    ``query`` passes ``preflight`` (for the advice: ``--kv-bits``), or ``None``."""
    for bits in (8, 4):
        if query.kv_bits is not None and bits >= query.kv_bits:
            continue
        try:
            preflight(dataclasses.replace(query, kv_bits=bits))
        except RequestRejected:
            continue
        return bits
    return None


def _log_refusal(error: RequestRejected) -> None:
    """Every refusal at WARNING, as the forward gate logs its own: an operator reading the
    log sees what was refused, where and why without the client's copy of the answer."""
    rejection = error.rejection
    log.warning("refused request %s (model %r) at %s (%s): %s", rejection.request_id,
                rejection.model_id, rejection.stage, rejection.cause, rejection.summary())
