"""The built-in ``distributed`` plugin: one model served by several processes (ranks)
joined by ``mx.distributed``, launched by ``mlx.launch`` (``omlx-core launch``).

What it provides through the public hooks:

- ``register_settings``: ``plugin.distributed.*`` (the split, heartbeats and liveness);
- ``register_engines``: ``"distributed"`` -> :class:`~.engine.DistributedEngine`, the
  batched engine with its model sharded through mlx-lm's ``shard`` (tensor parallel) or
  ``model.pipeline`` (pipeline) and its scheduler stepped in lockstep on every rank
  (:mod:`.step_sync`, over the scheduler's ``StepSync`` extension point);
- ``estimate_peak`` (a wrapper): a sharded model's estimate is one rank's share
  (:func:`~.rank_memory.per_rank_estimate`);
- ``preflight``: a request that can never fit on some rank is refused with a 413 naming
  the rank and its binding ceiling (every rank's readings are gathered on rank 0,
  :mod:`.rank_memory`);
- ``adjust_limits``: rank 0's admission and forward gate judge against the tightest
  rank (:func:`~.rank_memory.judged_limits`), and their refusals name it;
- ``resolve_scheduler`` comes from the batched plugin (the engine is a batched one).

Rank 0 serves HTTP; ``omlx-core serve`` on any other rank only follows. A rank that
dies or hangs makes the whole group exit with status
:data:`~.cluster.EXIT_GROUP_DEAD` after rank 0 ended its requests (:mod:`.cluster`).
See docs/distributed.md.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

from omlx_core.hookspecs import hookimpl
from omlx_core.settings import Setting

ENGINE_NAME = "distributed"

SETTINGS = (
    Setting("mode", "choice", "how the model is split over the ranks: tensor (heads and MLP "
            "columns) or pipeline (runs of layers)", default="tensor",
            choices=("tensor", "pipeline")),
    Setting("heartbeat_s", "float", "how often every rank sends a heartbeat (on a connection "
            "of its own) and an idle rank 0 steps the group", minimum=0.05, maximum=60.0,
            default=1.0),
    Setting("liveness_timeout_s", "float", "a rank that sends no heartbeat for this long is "
            "dead (stopped, hung, cut off); a killed one is noticed at once. However long a "
            "step takes, this bounds how long a dead rank goes unnoticed", minimum=1.0,
            maximum=600.0, default=5.0),
    Setting("stall_timeout_s", "float", "a step open this long while no rank uses CPU (every "
            "rank waiting on another) ends the group; 0 turns this off. Slow steps, where "
            "ranks compute, never do", minimum=0.0, maximum=86400.0, default=300.0),
    Setting("exit_after_s", "float", "how long rank 0 keeps answering /health (naming the "
            "missing rank) after the group died, before it exits", minimum=0.0, maximum=600.0,
            default=5.0),
)


@hookimpl
def register_settings(register: Callable[[Setting], None]) -> None:
    for setting in SETTINGS:
        register(setting)


@hookimpl
def register_engines(register: Callable[..., None]) -> None:
    from omlx_core.plugins.distributed.engine import DistributedEngine

    register(ENGINE_NAME, DistributedEngine)


__all__ = ["ENGINE_NAME", "SETTINGS"]


@hookimpl(wrapper=True)
def estimate_peak(query: Any) -> Generator[None, Any, Any]:
    from omlx_core.plugins.distributed.rank_memory import BOARDS, per_rank_estimate

    estimate = yield
    board = BOARDS.get(getattr(query, "model_id", ""))
    if estimate is None or board is None:
        return estimate
    return per_rank_estimate(estimate, board.kv_share)


@hookimpl
def preflight(request: Any) -> None:
    from omlx_core.scheduling import Rejection, RequestRejected
    from omlx_core.plugins.distributed.rank_memory import BOARDS

    board = BOARDS.get(request.model_id)
    if board is None or request.estimated_bytes is None:
        return
    for reading in board.readings():
        if reading.rank == 0 or reading.hard_bytes is None:
            continue  # rank 0's own guard checks rank 0
        margin = max(request.margin_bytes, reading.margin_bytes)
        needed = request.estimated_bytes + margin
        if reading.baseline_bytes + needed > reading.hard_bytes:
            size = board.cluster.size
            raise RequestRejected(Rejection(
                estimated_bytes=needed, limit_bytes=reading.hard_bytes,
                breakdown=reading.binding_breakdown(
                    size, f"on rank {reading.rank} of {size}, whose {reading.binding} "
                          "ceiling binds there"),
                request_id=request.request_id, model_id=request.model_id,
                prompt_tokens=request.prompt_tokens, stage="preflight",
                base_bytes=reading.baseline_bytes, cause="never_fits",
                margin_bytes=margin))


@hookimpl
def adjust_limits(snapshot: Any) -> Any:
    from omlx_core.plugins.distributed.rank_memory import BOARDS

    judged = None
    for board in list(BOARDS.values()):
        board.observe(snapshot)  # what this rank sends at the next gather
        if board.cluster.leader and judged is None:
            judged = board.judged(snapshot)
    return judged
