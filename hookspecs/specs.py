"""Hook specifications, grouped by the moment in a server's life they run.

Every hook is documented with one summary line, its parameters, what it returns, and
whether the first non-``None`` result wins (``firstresult``), and names the part of
core that calls it. A plugin implements any subset; parameter names must match, but a
plugin may accept fewer of them.

Engines never call hooks: core builds each engine an :class:`~omlx_core.host.EngineHost`
(:func:`omlx_core.bootstrap.create_engine`) whose sinks and cache tiers are the hooks
below, bound to that engine's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from omlx_core.hookspecs import hookspec

if TYPE_CHECKING:
    from omlx_core.config import Config
    from omlx_core.engine import Engine
    from omlx_core.memory.gate import MemoryReceiver
    from omlx_core.memory.types import (
        BoundarySnapshot,
        LimitSnapshot,
        PeakEstimate,
        PeakQuery,
        PreflightRequest,
        Rejection,
    )
    from omlx_core.platform.doctor import DoctorCheck
    from omlx_core.server_context import ServerContext
    from omlx_core.settings import Setting


# -- registration: runs once, when the plugin manager is built ---------------------------


@hookspec
def register_settings(register: Callable[[Setting], None]) -> None:
    """Declare the configuration keys this plugin reads.

    Keys live under ``[plugin.<name>]`` in a tier file; unknown keys there are errors,
    so a plugin with settings must declare them here.

    :param register: call ``register(Setting(...))`` once per key.
    :returns: nothing; results are ignored.
    """


@hookspec
def register_engines(register: Callable[..., None]) -> None:
    """Make engine types available to the model registry.

    A model entry in the configuration names its engine (``engine = "batched"``); the
    factory registered under that name builds the engine when the model loads
    (:func:`omlx_core.bootstrap.create_engine`, at start-up or later).

    :param register: call ``register(name, factory)`` where ``factory(model, host)``
        takes a :class:`~omlx_core.models.ModelSpec` and the engine's
        :class:`~omlx_core.host.EngineHost` and returns an :class:`~omlx_core.engine.Engine`.
    :returns: nothing; results are ignored. Two plugins registering one name is an error.
    """


@hookspec
def register_caches(register: Callable[..., None]) -> None:
    """Make lower KV cache tiers (a paged SSD store...) available to every engine.

    Core calls every registered factory when it builds an engine's host
    (:func:`omlx_core.bootstrap.build_host`) and hands the stores, in plugin order, to
    the engine as ``host.lower_tiers``; an engine with a prefix cache puts them behind
    it (the ``batched`` engine uses the first).

    :param register: call ``register(name, factory)`` where ``factory(model, config)``
        takes a :class:`~omlx_core.models.ModelSpec` and the effective
        :class:`~omlx_core.config.Config` and returns an
        :class:`~omlx_core.kvblocks.BlockStore` for that model, or ``None`` when the
        tier is off for it.
    :returns: nothing; results are ignored. Two plugins registering one name is an error.
    """


# -- process lifecycle ----------------------------------------------------------------------


@hookspec
def startup(context: ServerContext) -> None:
    """Run once when the server has loaded its configuration and before it takes requests.

    :param context: the running server: configuration, loaded engines, plugin manager.
    :returns: nothing; results are ignored. An exception aborts start-up with the
        plugin's name in the error.
    """


@hookspec
def shutdown(context: ServerContext) -> None:
    """Run once when the server stops, after the last request finished or was aborted.

    :param context: the same object :func:`startup` received.
    :returns: nothing; results are ignored. Exceptions are logged, never raised, so
        every plugin gets its turn.
    """


@hookspec
def doctor_checks(config: Config) -> list[DoctorCheck] | None:
    """Report what this plugin needs of the machine, as lines of ``omlx-core doctor``.

    :param config: the effective configuration of the tier the doctor inspects.
    :returns: a list of :class:`~omlx_core.platform.doctor.DoctorCheck` (name, status
        ``ok``/``warn``/``fail``, detail, and a fix for a problem), or ``None``. Every
        plugin's lines are shown after the core checks; a plugin whose check raises is
        shown as a failed line.
    """


# -- memory: estimate, limits, admission ----------------------------------------------------


@hookspec(firstresult=True)
def estimate_peak(query: PeakQuery) -> PeakEstimate | None:
    """Estimate the peak bytes a prefill will add on top of memory already in use.

    The query carries the model (dims from its config), ``new_tokens`` to prefill over
    ``cached_tokens`` already resident, in chunks of ``chunk_size``, and for a vision
    model the ``images`` it encodes first. An ``encode`` query is one forward of an
    embedding or reranking batch: ``rows`` inputs padded to ``new_tokens`` each, nothing
    cached, nothing held after it (its ``kv_bytes`` and ``kv_bytes_per_token`` are 0). The answer is structured so that every stage
    decides from one estimate: preflight and admission compare its ``total`` with the
    limit, admission grows a reservation by ``kv_bytes_per_token`` per completion token,
    and the forward gate keeps its ``held_bytes`` in use after a forward. The estimate
    must never undercount (that crashes machines) and should overcount by little. A
    wrapper may add to another plugin's answer (``PeakEstimate.plus_extra``: a draft
    model's weights and KV).

    :param query: a :class:`~omlx_core.memory.types.PeakQuery`.
    :returns: a :class:`~omlx_core.memory.types.PeakEstimate`: the worst step's
        ``transient_bytes``, the ``kv_bytes`` the prefill leaves held and
        ``kv_bytes_per_token``, and ``extra_bytes`` held beside the model's cache (image
        features, a draft model); or ``None`` to let the next implementation answer.
        firstresult: the first non-``None`` result is used.
    """


@hookspec(firstresult=True)
def resolve_scheduler(engine: Engine) -> MemoryReceiver | None:
    """Find the object that receives memory limits and the forward gate for an engine.

    Engines may wrap other engines (a speculative engine around a batched one); the
    enforcer asks this hook, on every poll, which object schedules prefills right now,
    so a wrapper that switches paths is followed. An engine whose primary path bypasses
    a scheduler returns its own guard object. The built-in ``memory_guard`` plugin
    answers last with the engine itself when it is its own receiver, else with the
    engine's ``host.memory`` (:class:`~omlx_core.host.HostMemory`), which an engine
    scheduling its own prefills reads. Called by core's memory enforcer on every poll
    (:mod:`omlx_core.memory.enforcer`) and at start-up, where a guarded engine nothing
    resolves is refused (:func:`omlx_core.bootstrap.create_engine`).

    :param engine: a loaded engine, possibly a wrapper.
    :returns: a :class:`~omlx_core.memory.gate.MemoryReceiver`, or ``None`` if this
        plugin does not know the engine. firstresult: the first non-``None`` result is used.
    """


@hookspec(firstresult=True)
def adjust_limits(snapshot: LimitSnapshot) -> LimitSnapshot | None:
    """Tighten the limits admission and the forward gates judge against.

    Called by :meth:`omlx_core.memory.guard.MemoryGuard.update` on the enforcer's thread
    with every snapshot it measured, before admission and the engines' receivers get
    it. For a plugin whose work also takes memory this process cannot measure (the
    other ranks of a distributed group): it answers the snapshot to judge by instead,
    e.g. a lower ``hard_bytes`` (the forward gate compares memory in use here with it)
    and a higher ``baseline_bytes`` (admission's budget is ``hard × admit_watermark -
    baseline - margin``), its ``margin_bytes`` the least margin charged, and its
    breakdown's ``elsewhere`` naming where the binding limit is, for refusals to say.
    Preflight and the reported memory keep the measured snapshot. Must be quick.

    :param snapshot: the :class:`~omlx_core.memory.types.LimitSnapshot` just measured.
    :returns: the snapshot to judge by, or ``None`` to judge by ``snapshot``
        (firstresult: the first non-``None`` answer wins).
    """


@hookspec
def preflight(request: PreflightRequest) -> None:
    """Check, before any response byte is sent, that a request can ever fit.

    Runs in the serving pipeline after tokenization (chat template applied, the same
    tokens the engine will prefill), before admission and before any response byte:
    called by :meth:`omlx_core.memory.guard.MemoryGuard.preflight`.

    :param request: a :class:`~omlx_core.memory.types.PreflightRequest`: request id,
        model, prompt and cached token counts, chunk size, the current limit snapshot.
    :returns: nothing. Raise :class:`~omlx_core.memory.types.RequestRejected` with a
        ``Rejection`` of stage ``"preflight"`` to refuse the request; the front end
        answers HTTP 413. Every implementation runs.
    """


@hookspec
def on_rejection(rejection: Rejection) -> str | None:
    """Turn a memory rejection into advice an operator can act on.

    Called by the memory guard (:meth:`omlx_core.memory.guard.MemoryGuard.advice`) for
    every rejection, at any stage, before it reaches the client.

    :param rejection: estimate, limit, the ceiling breakdown and which ceiling binds.
    :returns: one advice text, or ``None``. All non-``None`` results are shown, in hook
        call order. To replace the built-in advice rather than add to it, implement this
        as ``@hookimpl(wrapper=True)`` and return your own list.
    """


# -- caches ------------------------------------------------------------------------------------


@hookspec
def on_boundary_snapshot(snapshot: BoundarySnapshot) -> None:
    """Receive a non-sliceable cache state captured at a block boundary during prefill.

    Layers such as ``ArraysCache`` (GatedDeltaNet, Mamba) or rotating windows cannot be
    cut back to an earlier token count, so the engine captures them as prefill crosses
    each block boundary. They are keyed by **request id**: the batch slot does not
    exist yet while a request is prefilling. Engines report them to their host's
    ``on_boundary_snapshot`` sink, which core binds to this hook.

    :param snapshot: request id, block index, token count, chain hash of the block
        prefix, and the per-layer states.
    :returns: nothing; results are ignored. Implementations must not block the MLX
        thread: copy or enqueue, then return.
    """


@hookspec
def on_request_finished(model_id: str, request_id: str, finish_reason: str) -> None:
    """Learn that an engine has finished a request and released what it held.

    Pairs with :func:`on_boundary_snapshot`: a plugin that keeps state per request id
    (staged snapshots, traces) drops it here. Engines report it to their host's
    ``on_request_finished`` sink, which core binds to this hook with the model id. A
    request the pipeline aborts because a stop string matched ends with ``"abort"``.

    :param model_id: the model whose engine ran the request.
    :param request_id: the request's id, as in its snapshots and outputs.
    :param finish_reason: ``"stop"`` or ``"length"`` for a completed request,
        ``"abort"`` when the client went away, ``"error"`` when it failed.
    :returns: nothing; results are ignored. Runs on the MLX thread: do not block.
    """
