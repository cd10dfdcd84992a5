"""Every rank takes rank 0's steps: the batched scheduler's :class:`StepSync` over
``mx.distributed`` collectives.

Once per step rank 0 broadcasts what it drained (new requests with their prompt tokens,
sampling and seeds; aborted request ids) as a :mod:`.wire` message; the other ranks
decode it (nothing else: bytes that are not such a message end the group) and build the
same sequences and apply the same aborts. Whatever the memory guard decides inside a step (prefill
refusals, decode allowances and preemptions, resumes) rank 0's real forward gate
answers and :class:`CollectiveGate` broadcasts, so the other ranks follow it instead of
judging their own memory. Admission order, batch composition and sampling seeds are
then the same everywhere, and so is every forward. An idle rank 0 still steps every
``heartbeat_s`` (an empty exchange) so the others can tell it is alive.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, TypeVar

from omlx_core.scheduling import (
    UNLIMITED_TOKENS,
    CacheRestore,
    DecodePlan,
    DecodeStep,
    ForwardGate,
    PrefillStep,
    Refusals,
)
from omlx_core.scheduling import RequestRejected
from omlx_core.plugins.distributed.cluster import GroupDead
from omlx_core.plugins.distributed.wire import (
    WireError,
    decode_count,
    decode_flag,
    decode_plan,
    decode_refusals,
    decode_step,
    encode_count,
    encode_flag,
    encode_plan,
    encode_refusals,
    encode_step,
    encode_stop,
)

if TYPE_CHECKING:
    from omlx_core.engine import GenerationRequest
    from omlx_core.plugins.distributed.rank_memory import RankMemoryBoard
    from omlx_core.scheduling import SequenceState
    from omlx_core.plugins.distributed.cluster import Cluster

    T = TypeVar("T")

class FollowerStopped(RuntimeError):
    """Rank 0 shut its scheduler down; this rank stops too."""


class CollectiveSteps:
    """The step exchange of one model's scheduler on one rank.

    :param make_sequence: builds a follower's scheduler state for rank 0's request
        and seed.
    :param on_stop: called on a follower when rank 0 shut down; returns the ids of
        the requests it still runs (they are aborted).
    """

    def __init__(self, cluster: Cluster, *, heartbeat_s: float,
                 make_sequence: Callable[[GenerationRequest, int], SequenceState],
                 on_stop: Callable[[], list[str]],
                 memory: RankMemoryBoard | None = None) -> None:
        self.cluster = cluster
        self.heartbeat_s = heartbeat_s
        self._make_sequence = make_sequence
        self._on_stop = on_stop
        self.memory = memory
        self._last = time.monotonic()
        self._stopped = False
        self.exchanges = 0

    def exchange(self, arrivals: list[SequenceState], aborts: list[str]
                 ) -> tuple[list[SequenceState], list[str]]:
        cluster = self.cluster
        cluster.step_started()
        self._last = time.monotonic()
        self.exchanges += 1
        if cluster.leader:
            cluster.broadcast(encode_step([(s.request, s.seed) for s in arrivals], aborts))
            self._gather_memory()
            return arrivals, aborts
        step = receive(cluster, decode_step, "step")
        if step.stop:
            self._stopped = True
            cluster.stopping()
            return [], self._on_stop()
        self._gather_memory()
        return ([self._make_sequence(request, seed) for request, seed in step.arrivals],
                list(step.aborts))

    def _gather_memory(self) -> None:
        if self.memory is not None:
            self.memory.gather()

    def has_work(self, local: bool) -> bool:
        self.cluster.step_ended()
        if self.cluster.dead is not None or self._stopped:
            return False
        if not self.cluster.leader:
            # A follower waits in the next exchange for rank 0's step.
            return True
        return local or time.monotonic() >= self._last + self.heartbeat_s

    def wake_at(self, local: float | None) -> float | None:
        heartbeat = self._last + self.heartbeat_s
        return heartbeat if local is None else min(local, heartbeat)

    def gate(self, gate: ForwardGate | None) -> ForwardGate:
        return CollectiveGate(self.cluster, gate)

    def failed(self, exc: BaseException) -> None:
        # The ranks no longer take the same steps (a collective broke, or one rank's
        # step raised): the group cannot go on.
        self.cluster.declare_dead(
            f"a step failed on rank {self.cluster.rank} ({type(exc).__name__}: {exc}); "
            f"{self.cluster.missing()} is gone or out of step")

    def close(self) -> None:
        if self.cluster.leader and self.cluster.dead is None and not self._stopped:
            self._stopped = True
            self.cluster.step_started()
            self.cluster.broadcast(encode_stop())
            self.cluster.step_ended()
            self.cluster.stopping()


class CollectiveGate(ForwardGate):
    """Rank 0's forward gate, its answers broadcast: every rank asks it at the same
    point of the same step, so each gets the same answer."""

    def __init__(self, cluster: Cluster, gate: ForwardGate | None) -> None:
        self.cluster = cluster
        self.inner = gate

    def _agree(self, ask: Callable[[ForwardGate], T], default: T,
               encode: Callable[[T], bytes], decode: Callable[[bytes], T], what: str) -> T:
        if self.cluster.leader:
            answer = ask(self.inner) if self.inner is not None else default
            self.cluster.broadcast(encode(answer))
            return answer
        return receive(self.cluster, decode, what)

    def _refusals(self, ask: Callable[[ForwardGate], Refusals]) -> Refusals:
        return self._agree(ask, {}, encode_refusals, decode_refusals, "refusals")

    def check_prefill(self, step: PrefillStep) -> Refusals:
        return self._refusals(lambda gate: gate.check_prefill(step))

    def check_after_prefill(self, step: PrefillStep) -> Refusals:
        return self._refusals(lambda gate: gate.check_after_prefill(step))

    def check_decode(self, step: DecodeStep) -> DecodePlan:
        return self._agree(lambda gate: gate.check_decode(step),
                           DecodePlan({row.request_id: UNLIMITED_TOKENS for row in step.rows}),
                           encode_plan, decode_plan, "decode plan")

    def may_resume(self, request_id: str) -> bool:
        return self._agree(lambda gate: bool(gate.may_resume(request_id)), True, encode_flag,
                           decode_flag, "resume answer")

    def room_for_restore(self, restore: CacheRestore) -> int:
        # Every rank then reuses the same prefix of the same cache.
        return self._agree(lambda gate: int(gate.room_for_restore(restore)), restore.nbytes,
                           encode_count, decode_count, "restore answer")

    def suspend(self, request_id: str) -> None:
        if self.cluster.leader and self.inner is not None:
            self.inner.suspend(request_id)


def receive(cluster: Cluster, decode: Callable[[bytes], T], what: str) -> T:
    """Rank 0's next broadcast, decoded; bytes that are not that message end the group
    (this rank can no longer take rank 0's steps)."""
    try:
        return decode(cluster.broadcast(None))
    except WireError as exc:
        cluster.declare_dead(f"rank {cluster.rank} received a {what} it cannot read ({exc}); "
                             "the ring link carries something other than rank 0's messages")
        raise GroupDead(cluster.dead) from exc
