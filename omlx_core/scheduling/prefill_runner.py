"""A scheduler step's prefill: the planned forwards, then the first tokens.

The planner (:mod:`~omlx_core.scheduling.prefill_planner`) cuts the step's chunks
and forwards and asks the forward gate. A request the gate refuses with ``wait`` (other
requests of this engine run on, or a helper's work in flight holds the memory, and give
it back by themselves) is preempted: it waits, its finished chunks in the prefix cache;
any other refused request ends with ``finish_reason="error"`` and the gate's
:class:`~omlx_core.memory.types.RequestRejected`.
Either way its cache is dropped, and the other chunks and streams go on.

At the end of the step every request whose chunks are done has its last prompt token
fed (shared one-token forwards where caches allow, grouped like chunks so that a long
cached prefix is never copied into a batch buffer; one token of logits each) and its
first token sampled: the runner returns those first tokens, and the scheduler hands
them out and moves their requests on (into the decode batch, or done). Requests the
runner cannot go on with it hands back through the scheduler's ``finish`` and
``requeue``: the scheduler alone moves a request between phases.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream

from omlx_core.scheduling.batch_prefill import PrefillRow, can_batch, prefill_together
from omlx_core.scheduling.batch_state import PREFILLING, BatchState, SequenceState
from omlx_core.scheduling.decode_batch import finish_reason
from omlx_core.scheduling.extensions import ChunkInputs
from omlx_core.scheduling.prefill_planner import Chunk, PrefillPlanner
from omlx_core.scheduling.prefix_writer import PrefixCacheWriter
from omlx_core.scheduling.sampling import make_logits_processors, make_sampler

if TYPE_CHECKING:
    from omlx_core.memory.types import RequestRejected

log = logging.getLogger(__name__)


@dataclass
class FirstToken:
    """A request's first token (or, resumed, its next), sampled at the end of prefill."""

    sequence: SequenceState
    token: int
    logprobs: mx.array
    #: ``"stop"`` or ``"length"`` when the token ends the request
    finish_reason: str | None


class PrefillRunner:
    """Runs the planned prefill forwards and the first-token forwards.

    :param finish: ends a request (the scheduler's), as ``finish(sequence, reason,
        error=..., error_type=..., rejected=...)``.
    :param requeue: puts requests refused for memory back in the queue (the scheduler's).
    """

    def __init__(self, *, model: Any, state: BatchState, vocab_size: int, eos_token_ids: Any,
                 planner: PrefillPlanner, inputs: ChunkInputs, writer: PrefixCacheWriter,
                 finish: Callable[..., None], requeue: Callable[[list[SequenceState]], None]) -> None:
        self.model = model
        self.state = state
        self.counters = state.counters
        self.vocab_size = vocab_size
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.planner = planner
        self.inputs = inputs
        self.writer = writer
        self.finish = finish
        self.requeue = requeue

    def step(self) -> list[FirstToken]:
        """Run the step's planned chunks; return the first tokens of the requests whose
        prompt is now all in their cache."""
        planner, state = self.planner, self.state
        plan = planner.plan()
        groups = planner.forward_groups(plan)
        refused, broken = planner.ask_gate(plan, groups)
        if refused and any(len(group) > 1 for group in groups):
            # A shared forward holds its chunks' transients at once. When the gate says
            # that does not fit, ask again for one forward per chunk before refusing.
            groups = [[chunk] for chunk in plan]
            refused, broken = planner.ask_gate(plan, groups)
        if broken is not None:
            for sequence in {id(s): s for s, _, _ in plan}.values():
                self.finish(sequence, "error", error=broken, error_type="internal")
        for request_id, rejected in refused.items():
            sequence = state.by_id.get(request_id)
            if sequence is not None and sequence.phase == PREFILLING:
                if rejected.wait:
                    # What holds the memory it needs gives it back by itself (the
                    # engine's other requests, a grammar compile): it waits (its finished
                    # chunks stay in the prefix cache), not fails. The gate judged this
                    # against the step's running requests, not what is left of them
                    # after the refusals before it were put back.
                    self.requeue([sequence])
                else:
                    # Nothing that runs gives it back: memory went elsewhere (another
                    # process), and waiting would not bring it back.
                    self.finish(sequence, "error", error=str(rejected), rejected=rejected)
        for group in groups:
            if len(group) == 1:
                self._prefill_alone(*group[0])
            else:
                self._prefill_together(group)
        firsts = self.first_tokens()
        mx.clear_cache()
        return firsts

    def _prefill_alone(self, sequence: SequenceState, start: int, end: int) -> None:
        if sequence.phase != PREFILLING:
            return
        try:
            self._prefill_chunk(sequence, start, end)
        except Exception as exc:
            # The chunk's forward touched only this request's own cache.
            self._prefill_failed(sequence, exc)

    def _prefill_together(self, group: list[Chunk]) -> None:
        """One forward over several requests' chunks; one by one if it fails."""
        members = [chunk for chunk in group if chunk[0].phase == PREFILLING]
        if len(members) > 1:
            rows = [PrefillRow(s.cache, s.context[start:end], start) for s, start, end in members]
            try:
                with mx.stream(generation_stream):
                    prefill_together(self.model, rows)
            except Exception:
                # Nothing was written to the requests' caches: each can still run alone.
                log.exception("batched prefill of requests %s failed; prefilling them one by one",
                              ", ".join(s.request_id for s, _, _ in members))
            else:
                self.counters.prefill_forwards += 1
                del rows  # a request stopped below must not stay referenced here
                stopped = self.planner.check_after_forward(members)
                for sequence, start, end in members:
                    try:
                        self._chunk_done(sequence, start, end, stopped)
                    except Exception as exc:
                        self._prefill_failed(sequence, exc)
                return
        for chunk in members:
            self._prefill_alone(*chunk)

    def _prefill_failed(self, sequence: SequenceState, exc: Exception, what: str = "prefill") -> None:
        log.exception("%s of request %s failed", what, sequence.request_id)
        self.finish(sequence, "error", error=f"{what} failed: {type(exc).__name__}: {exc}",
                            error_type="internal")

    def _prefill_chunk(self, sequence: SequenceState, start: int, end: int) -> None:
        with mx.stream(generation_stream):
            tokens = mx.array(sequence.context[start:end])[None]
            if self.inputs.embeds(sequence, start, end):
                embeddings = self.inputs.embeddings(sequence, start, end)
                self.model(tokens, cache=sequence.cache, input_embeddings=embeddings[None])
                del embeddings
            else:
                self.model(tokens, cache=sequence.cache)
            mx.eval([layer.state for layer in sequence.cache])
        self.counters.prefill_forwards += 1
        self._chunk_done(sequence, start, end, self.planner.check_after_forward([(sequence, start, end)]))

    def _chunk_done(self, sequence: SequenceState, start: int, end: int,
                    stopped: tuple[SequenceState, RequestRejected] | None) -> None:
        """Account for a chunk whose forward has run and store its blocks; after the
        last one the request waits for :meth:`first_tokens` at the end of the step.
        ``stopped``: the request the post-forward backstop stops after this forward,
        with the reason (:meth:`~.prefill_planner.PrefillPlanner.check_after_forward`)."""
        sequence.prefilled = end
        self.counters.prefill_chunks += 1
        self.counters.prompt_tokens_prefilled += end - start
        if stopped is not None and stopped[0] is sequence:
            self.finish(sequence, "error", error=str(stopped[1]), rejected=stopped[1])
            return
        self.writer.store_prefill_blocks(sequence)
        if end == sequence.prefill_target or end in sequence.request.cache_points:
            self.writer.store_prefill_tail(sequence)

    # -- first token -----------------------------------------------------------------

    def first_tokens(self) -> list[FirstToken]:
        """Feed the last prompt token of every request whose prefill is done and sample
        its first token, to be handed out at once (the decode batch's pipelined step
        would hand it out a step later). Requests whose caches allow it and whose cached prefix is at most
        ``prefill_step_size`` tokens share one forward; a longer one runs alone, since a
        shared forward copies every row's prefix (right-aligned to the longest) into its
        batch buffer. The copy is thus at most ``max_batch_size`` x ``prefill_step_size``
        tokens of KV, the padding the decode batch these requests join next holds too.
        (Unlike chunks, one-token rows are not split to bound padding: the padding here is
        that bounded copy, and another forward costs far more.)
        """
        prefilling = self.state.prefilling
        ready = [s for s in prefilling if s.prefilled == s.prefill_target]
        if not ready:
            return []
        logits: dict[int, mx.array] = {}
        limit = self.planner.prefill_step_size
        members = [s for s in ready if can_batch(s.cache or ()) and s.prefill_target <= limit]
        if len(members) > 1:
            rows = [PrefillRow(s.cache, s.context[-1:], s.prefill_target) for s in members]
            try:
                with mx.stream(generation_stream):
                    found = prefill_together(self.model, rows, logits=True)
            except Exception:
                log.exception("first-token forward of requests %s failed; feeding them one by one",
                              ", ".join(s.request_id for s in members))
            else:
                self.counters.first_token_forwards += 1
                logits.update((id(s), row) for s, row in zip(members, found))
        for sequence in ready:
            if id(sequence) in logits:
                continue
            try:
                with mx.stream(generation_stream):
                    row = self.model(mx.array(sequence.context[-1:])[None], cache=sequence.cache)[:, -1, :]
                    mx.eval(row, [layer.state for layer in sequence.cache])
            except Exception as exc:
                self._prefill_failed(sequence, exc, "first-token forward")
                continue
            self.counters.first_token_forwards += 1
            logits[id(sequence)] = row
        firsts = []
        for sequence in ready:
            if id(sequence) not in logits or sequence.phase != PREFILLING:
                continue
            try:
                firsts.append(self._first_token(sequence, logits[id(sequence)]))
            except Exception as exc:
                log.exception("request %s failed while sampling its first token", sequence.request_id)
                self.finish(sequence, "error", error=f"{type(exc).__name__}: {exc}",
                            error_type="internal")
        return firsts

    def _first_token(self, sequence: SequenceState, logits: mx.array) -> FirstToken:
        """Sample from the last prompt token's ``(1, vocab)`` logits, as the decode batch
        would (same processors, same sampler, which it then goes on with). A resumed
        request samples its next completion token with the sampler and processors it
        had."""
        sampling = sequence.request.sampling
        if not sequence.preemptions:
            sequence.sampler = make_sampler(sampling, sequence.seed, self.vocab_size)
            sequence.processors = make_logits_processors(sampling, len(sequence.prompt))
            sequence.stop_ids = self.eos | {int(t) for t in (sampling.stop_token_ids or ())}
            if sequence.grammar is not None:
                # Last: the mask applies to the logits after bias and penalties.
                sequence.processors += (sequence.grammar.processor(prompt_length=len(sequence.prompt)),)
        if sequence.processors:
            context = mx.array(sequence.context)
            for processor in sequence.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if sequence.sampler is None:
            token = int(mx.argmax(logprobs, axis=-1).item())
        else:
            token = int(sequence.sampler(logprobs).item())
        return FirstToken(sequence, token, logprobs[0], finish_reason(sequence, 0, token))


__all__ = ["FirstToken", "PrefillRunner"]
