"""The built-in ``distributed`` plugin: one model served by several processes (ranks)
joined by ``mx.distributed``, launched by ``mlx.launch`` (``omlx-core launch``).

What it provides through the public hooks:

- ``register_settings``: ``plugin.distributed.*`` (the split, heartbeat and fault
  timeouts);
- ``register_engines``: ``"distributed"`` -> :class:`~.engine.DistributedEngine`, the
  batched engine with its model sharded through mlx-lm's ``shard`` (tensor parallel) or
  ``model.pipeline`` (pipeline) and its scheduler stepped in lockstep on every rank
  (:mod:`.step_sync`, over the scheduler's ``StepSync`` extension point);
- ``resolve_scheduler`` comes from the batched plugin (the engine is a batched one).

Rank 0 serves HTTP; ``omlx-core serve`` on any other rank only follows. A rank that
dies or hangs makes the whole group exit with status
:data:`~.cluster.EXIT_GROUP_DEAD` after rank 0 ended its requests (:mod:`.cluster`).
See docs/distributed.md.
"""

from __future__ import annotations

from typing import Callable

from omlx_core.hookspecs import hookimpl
from omlx_core.settings import Setting

ENGINE_NAME = "distributed"

SETTINGS = (
    Setting("mode", "choice", "how the model is split over the ranks: tensor (heads and MLP "
            "columns) or pipeline (runs of layers)", default="tensor",
            choices=("tensor", "pipeline")),
    Setting("heartbeat_s", "float", "how often an idle rank 0 steps the group so the other "
            "ranks know it is alive", minimum=0.05, maximum=60.0, default=1.0),
    Setting("collective_timeout_s", "float", "how long one step's collectives may take before "
            "the group is declared dead (a rank killed or hung)", minimum=1.0, maximum=3600.0,
            default=10.0),
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
