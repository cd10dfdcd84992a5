"""The memory guard as the front end sees it: two calls made in the HTTP responder,
before any response byte.

``preflight`` refuses a request that can never fit (HTTP 413); ``admit`` waits until a
request that fits alone also fits next to the running ones, or raises
:class:`~omlx_core.memory.types.AdmissionQueueFullError` (HTTP 503). The returned
ticket is released when the request ends.

:class:`DefaultMemoryGuard` is the implementation :func:`install_memory_guard` puts on
``context.memory_guard`` at start-up; it also owns the enforcer thread and the forward
gate each engine's scheduler consults before a prefill chunk.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Protocol, Sequence

from omlx_core.memory.admission import AdmissionQueue, AdmissionTicket
from omlx_core.memory.ceilings import ProbeReadings, TierPolicy
from omlx_core.memory.enforcer import MemoryEnforcer
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.types import (
    LimitSnapshot,
    PeakQuery,
    PreflightRequest,
    PrefillMemoryExceededError,
    Rejection,
)
from omlx_core.memory.usage import MemoryUsage, return_freed_buffers_to_the_os

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.engine import Engine
    from omlx_core.pluginmanager import PluginManager
    from omlx_core.server_context import ServerContext

log = logging.getLogger(__name__)


class MemoryGuard(Protocol):
    def preflight(self, engine: Engine, request_id: str, prompt_tokens: Sequence[int]) -> None:
        """Raise PrefillMemoryExceededError if the request can never fit."""

    def admit(self, engine: Engine, request_id: str,
              prompt_tokens: Sequence[int]) -> ContextManager[None]:
        """Block until admitted; the context manager releases the reservation on exit."""


class DefaultMemoryGuard:
    """The memory guard omlx-core installs: estimate and rejection through the plugin
    hooks, budget admission (:mod:`.admission`), a forward gate per engine
    (:mod:`.forward_gate`), limits kept fresh by the :mod:`.enforcer`.

    :param plugins: the plugin manager whose ``estimate_peak``, ``preflight``,
        ``on_rejection`` and ``resolve_scheduler`` hooks are called.
    :param config: the effective configuration (``[memory]``, ``[engine]``).
    :param usage: where current use is read (tests pass fake readers).
    """

    def __init__(self, plugins: PluginManager, config: Config, *,
                 usage: MemoryUsage | None = None):
        self.plugins = plugins
        self.config = config
        self.policy = TierPolicy.from_config(config)
        poll = float(config["memory.poll_interval_s"])
        self.usage = usage or MemoryUsage(window_s=2 * poll)
        self.transient_margin = int(config["memory.transient_margin"])
        self.admission = AdmissionQueue(int(config["memory.queue_size"]),
                                        float(config["memory.queue_timeout_s"]),
                                        self.policy.admit_watermark)
        self.backend = mlx_backend()
        self.enforcer: MemoryEnforcer | None = None
        self._snapshot: LimitSnapshot | None = None
        self._gates: dict[int, tuple[Any, PrefillForwardGate]] = {}
        self._warned: set[str] = set()

    # -- limits ------------------------------------------------------------------------

    @property
    def snapshot(self) -> LimitSnapshot | None:
        """The latest published limits (one immutable object; read it once per decision)."""
        return self._snapshot

    def update(self, snapshot: LimitSnapshot) -> None:
        self._snapshot = snapshot
        self.admission.update(snapshot)

    def idle(self) -> bool:
        return self.admission.idle()

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    def start(self, engines: Callable[[], Iterable[Engine]], *,
              read: Callable[[], ProbeReadings] | None = None) -> MemoryEnforcer:
        """Start the enforcer over ``engines`` (re-listed on every poll)."""
        if self.enforcer is None:
            kwargs = {"read": read} if read is not None else {}
            self.enforcer = MemoryEnforcer(
                self, engines, lambda engine: self.plugins.hook.resolve_scheduler(engine=engine),
                self.policy, float(self.config["memory.poll_interval_s"]), **kwargs)
            self.enforcer.start()
        return self.enforcer

    def close(self) -> None:
        if self.enforcer is not None:
            self.enforcer.stop()
            self.enforcer = None

    # -- estimates ---------------------------------------------------------------------

    def peak_query(self, engine: Engine, prompt_tokens: Sequence[int],
                   extra_tokens: int = 0) -> PeakQuery:
        """The ``estimate_peak`` question for prefilling ``prompt_tokens`` on ``engine``.

        Engine hints, each optional: ``prefill_step_size`` (else ``engine.prefill_step_size``
        from the configuration), ``prefill_full_logits`` (default True: an engine that
        does not say may evaluate every prompt position's logits),
        ``activation_dtype_bytes`` (default 4) and ``cached_kv_is_resident`` (default
        False: a reused prefix is copied into the request's own cache, so its KV is
        allocated again; only the forwards it saves are subtracted).
        """
        cached = min(int(engine.cached_tokens(prompt_tokens)), max(0, len(prompt_tokens) - 1))
        chunk = (getattr(engine, "prefill_step_size", None)
                 or int(self.config["engine.prefill_step_size"]))
        return PeakQuery(
            model_config=dict(engine.model.config),
            new_tokens=len(prompt_tokens) - cached + extra_tokens, cached_tokens=cached,
            chunk_size=int(chunk),
            dtype_bytes=int(getattr(engine, "activation_dtype_bytes", None) or 4),
            full_logits=bool(getattr(engine, "prefill_full_logits", True)),
            model_id=engine.model.id,
            cached_kv_resident=bool(getattr(engine, "cached_kv_is_resident", False)),
            backend=self.backend)

    def estimate(self, query: PeakQuery) -> int | None:
        result = self.plugins.hook.estimate_peak(query=query)
        if result is None and query.model_id not in self._warned:
            self._warned.add(query.model_id)
            log.warning("no estimate_peak plugin can estimate model %r (model_type %r): its "
                        "requests are not checked against memory; enable the built-in "
                        "'estimator' plugin or install one for this architecture",
                        query.model_id, query.model_config.get("model_type"))
        return None if result is None else int(result)

    def advice(self, rejection: Rejection) -> list[str]:
        """Advice from every ``on_rejection`` implementation, in hook order."""
        try:
            results = self.plugins.hook.on_rejection(rejection=rejection)
        except Exception:
            log.exception("an on_rejection plugin failed; the rejection goes out without advice")
            return []
        return [str(text) for text in (results or []) if text]

    # -- the three stages ----------------------------------------------------------------

    def preflight(self, engine: Engine, request_id: str, prompt_tokens: Sequence[int]) -> None:
        """Raise :class:`PrefillMemoryExceededError` if the request can never fit."""
        snapshot = self._snapshot
        query = self.peak_query(engine, prompt_tokens)
        estimated = self.estimate(query)
        request = PreflightRequest(
            request_id=request_id, model_id=engine.model.id, prompt_tokens=len(prompt_tokens),
            cached_tokens=query.cached_tokens, chunk_size=query.chunk_size,
            estimated_bytes=estimated, limits=snapshot, model_config=query.model_config)
        try:
            self.plugins.hook.preflight(request=request)
        except PrefillMemoryExceededError as exc:
            if exc.advice:
                raise
            raise PrefillMemoryExceededError(exc.rejection, self.advice(exc.rejection)) from None

    def admit(self, engine: Engine, request_id: str, prompt_tokens: Sequence[int], *,
              max_tokens: int = 0) -> AdmissionTicket:
        """Block until the request fits next to the running ones; see :mod:`.admission`.

        ``max_tokens`` adds the KV its completion will grow to the reservation. Requests
        of one engine share its padded decode batch unless the engine declares
        ``decode_batch_padded = False``.
        """
        estimated = self.estimate(self.peak_query(engine, prompt_tokens, extra_tokens=max_tokens))
        batch = id(engine) if getattr(engine, "decode_batch_padded", True) else None
        return self.admission.admit(request_id, estimated or 0, batch)

    def forward_gate_for(self, engine: Engine) -> PrefillForwardGate:
        """The forward gate installed in ``engine``'s scheduler (one per engine)."""
        entry = self._gates.get(id(engine))
        if entry is None or entry[0] is not engine:
            gate = PrefillForwardGate(
                self.estimate, self.usage, self.transient_margin, self.advice,
                dtype_bytes=int(getattr(engine, "activation_dtype_bytes", None) or 4),
                backend=self.backend)
            entry = self._gates[id(engine)] = (engine, gate)
        return entry[1]


def mlx_backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where mlx runs prefills in this process."""
    try:
        import mlx.core as mx
    except ImportError:
        return "cpu"
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if hasattr(mx, "metal") and mx.metal.is_available():
        return "metal"
    return "cuda"


def install_memory_guard(context: ServerContext) -> DefaultMemoryGuard:
    """Create the guard for a started server, start its enforcer over the context's
    engines and set ``context.memory_guard``."""
    return_freed_buffers_to_the_os()
    for hook, consequence in (
            ("estimate_peak", "no request is checked against memory"),
            ("preflight", "requests that can never fit are not refused before streaming"),
            ("resolve_scheduler", "engines without their own resolver get no memory limits")):
        if not getattr(context.plugins.hook, hook).get_hookimpls():
            log.warning("no loaded plugin implements %s: %s (enable the built-in "
                        "'estimator' and 'memory_guard' plugins)", hook, consequence)
    guard = DefaultMemoryGuard(context.plugins, context.config)
    guard.start(lambda: context.engines.values())
    context.memory_guard = guard
    return guard
