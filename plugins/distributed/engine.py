"""The ``distributed`` engine: the batched engine with its model sharded over the
``mx.distributed`` group, every rank stepping its scheduler in lockstep with rank 0's.

Rank 0 serves HTTP and submits requests; the other ranks only follow
(:mod:`.step_sync`). The prefix cache is off: what it keeps, and when the memory guard
makes it give memory back, is each rank's own, and a hit on one rank and a miss on
another would run different forwards.
"""

from __future__ import annotations

import logging
import os
import signal
import weakref
from typing import TYPE_CHECKING, Any

from omlx_core.engine import GenerationOutput, QueuedRequestHandle
from omlx_core.scheduling import ModelError
from omlx_core.scheduling import BatchedEngine, PrefixCache, Scheduler
from omlx_core.scheduling import Phase, new_sequence
from omlx_core.plugins.distributed.cluster import Cluster, cluster
from omlx_core.plugins.distributed.rank_memory import BOARDS, RankMemoryBoard
from omlx_core.plugins.distributed.sharding import load_sharded
from omlx_core.plugins.distributed.step_sync import CollectiveSteps

if TYPE_CHECKING:
    from omlx_core.engine import GenerationRequest
    from omlx_core.host import EngineHost
    from omlx_core.scheduling import ModelSpec
    from omlx_core.scheduling import SequenceState

log = logging.getLogger(__name__)

#: the clusters that already serve a model (one model per group)
_ENGINES: set[Cluster] = set()


class DistributedEngine(BatchedEngine):
    """Serves one mlx-lm model sharded over the ranks ``mlx.launch`` started."""

    def __init__(self, model: ModelSpec, host: EngineHost) -> None:
        super().__init__(model, host)
        config = host.config
        self.mode = str(config["plugin.distributed.mode"])
        self.heartbeat_s = float(config["plugin.distributed.heartbeat_s"])
        self.cluster: Cluster = cluster(
            heartbeat_s=self.heartbeat_s,
            liveness_timeout_s=float(config["plugin.distributed.liveness_timeout_s"]),
            stall_timeout_s=float(config["plugin.distributed.stall_timeout_s"]),
            exit_after_s=float(config["plugin.distributed.exit_after_s"]))
        if self.cluster in _ENGINES:
            # Each engine's steps are exchanged on the one group: two would interleave
            # differently on rank 0 (which steps on demand) and the followers.
            raise ModelError(f"model {model.id!r}: a distributed group serves one model, and "
                              "this one already serves another; start a group per model")
        _ENGINES.add(self.cluster)
        self.prefix_cache = PrefixCache(self.settings.block_size, 0,
                                        namespace=f"{model.id}\0{model.path}")
        self.step_sync: CollectiveSteps | None = None
        self._live: weakref.WeakSet[SequenceState] = weakref.WeakSet()
        #: sequences started on this rank so far (the memory board's idle baseline)
        self._started = 0
        self.cluster.on_death(self._end_in_flight)

    def _load(self) -> Scheduler:
        from omlx_core.scheduling import TierPolicy

        # Every rank loads and checks at once: a forward over shards runs on all of them.
        lm, tokenizer = load_sharded(self.model.path, self.mode, self.cluster.group)
        self.adopt(lm, tokenizer)

        board = RankMemoryBoard(self.cluster, self.mode, _layers(self.model.config),
                                TierPolicy.from_config(self.host.config).admit_watermark,
                                activity=self._activity)
        BOARDS[self.model.id] = board
        self.step_sync = CollectiveSteps(self.cluster, heartbeat_s=self.heartbeat_s,
                                         make_sequence=self._follow, on_stop=self._stop_following,
                                         memory=board)
        # No in-batch speculation, no decode-gap chunk sizing and no decode lanes: they
        # decide from step timings or from this rank's share of the weights and KV, which
        # differ from rank to rank, and every rank must take rank 0's steps.
        return Scheduler(
            model=lm, tokenizer=tokenizer, model_id=self.model.id, model_config=self.model.config,
            vocab_size=self.vocab_size, max_batch_size=self.settings.max_batch_size,
            prefill_step_size=self.settings.prefill_step_size, prefix_cache=self.prefix_cache,
            batch_window_s=self.settings.batch_window_s,
            batch_window_max_s=self.settings.batch_window_max_s,
            wake=self._thread.wake, boundary_listener=self.host.on_boundary_snapshot,
            finish_listener=self.host.on_request_finished, step_sync=self.step_sync,
            kv_format=self.kv_format,
            decode_lanes=False,
        )

    # -- requests --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> QueuedRequestHandle:
        dead = self.cluster.dead
        if dead is None:
            return super().submit(request)
        outputs = _queue()
        outputs.put(_group_dead_output(request.request_id, dead))
        return QueuedRequestHandle(request.request_id, outputs, self.abort)

    def _new_sequence(self, request: GenerationRequest) -> Any:
        sequence = new_sequence(request)
        self._started += 1
        self._live.add(sequence)
        return sequence

    def _follow(self, request: GenerationRequest, seed: int) -> SequenceState:
        """A follower's state for the request rank 0 admitted, with rank 0's seed."""
        sequence = new_sequence(request)
        sequence.seed = seed
        self._started += 1
        self._live.add(sequence)
        self.constrain(sequence)
        return sequence

    def _activity(self) -> tuple[int, bool]:
        """Sequences started so far, and whether one runs now (any thread)."""
        return self._started, any(s.phase is not Phase.DONE for s in list(self._live))

    def _stop_following(self) -> list[str]:
        """Rank 0 shut down: abort what this follower still runs, then stop."""
        _stop_this_process()
        return [s.request_id for s in list(self._live) if s.phase is not Phase.DONE]

    def shutdown(self) -> None:
        super().shutdown()
        BOARDS.pop(self.model.id, None)
        _ENGINES.discard(self.cluster)
        self.cluster.close()

    def _end_in_flight(self, reason: str) -> None:
        """The group died: the MLX thread is stuck in a collective, so every request
        still running gets its final output from here."""
        for sequence in list(self._live):
            if sequence.phase is not Phase.DONE:
                sequence.outputs.put(_group_dead_output(sequence.request_id, reason))

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats.update(distributed_mode=self.mode, distributed_rank=self.cluster.rank,
                     distributed_ranks=self.cluster.size, distributed_error=self.cluster.dead,
                     distributed_exchanges=self.step_sync.exchanges if self.step_sync else 0)
        board = BOARDS.get(self.model.id)
        if board is not None and self.cluster.leader:
            stats["distributed_memory"] = [
                {"rank": r.rank, "hard_limit_bytes": r.hard_bytes, "binding_ceiling": r.binding,
                 "baseline_bytes": r.baseline_bytes, "in_use_bytes": r.in_use_bytes,
                 "margin_bytes": r.margin_bytes, "admit_watermark": round(r.admit_watermark, 4)}
                for r in board.readings()]
        return stats


def _layers(config: Any) -> int:
    for table in (config, config.get("text_config") or {}):
        value = table.get("num_hidden_layers")
        if isinstance(value, int):
            return value
    return 0


def _queue() -> Any:
    import queue

    return queue.SimpleQueue()


def _group_dead_output(request_id: str, reason: str) -> GenerationOutput:
    return GenerationOutput(request_id=request_id, finish_reason="abort",
                            error=f"the distributed group serving this model is dead: {reason}; "
                                  "the server exits so its supervisor restarts the group")


def _stop_this_process() -> None:
    """Stop this follower as a SIGTERM would (``omlx-core serve`` handles it and stops
    its engines)."""
    log.info("rank 0 shut the group down; this rank stops")
    os.kill(os.getpid(), signal.SIGTERM)
