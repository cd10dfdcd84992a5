"""Driving an engine from a test the way the serving pipeline does, every wait bounded.

Each helper reads a :class:`~omlx_core.engine.RequestHandle` with
:meth:`~omlx_core.engine.RequestHandle.next_output` and a deadline, so an engine that
hangs, never ends a request, or streams past what it was asked for fails the test that
drove it with a message saying which, instead of hanging the test run.
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence

from omlx_core.engine import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
)
from omlx_core.serving.output import OutputProcessor
from omlx_core.testing.sampling_check import END

#: a prompt long enough that every engine prefills it before its first token
PROMPT = [(17 * i) % 90 + 20 for i in range(40)]
#: seconds any one request may take on a tiny model before it counts as a hang
TIMEOUT_S = 60.0
#: tokens an engine may still stream after it was asked to stop (an abort, or the abort a
#: matched stop string causes): what was already on its way plus one step's worth, a
#: speculative block included
AFTER_ABORT_TOKENS = 32
#: ``max_tokens`` of a request that only an abort may end
ENDLESS = 10_000


def fresh_prompt(salt: int, length: int = 40) -> list[int]:
    """A prompt no earlier request shares a prefix with (a prefix cache cannot skip its
    prefill)."""
    return [(salt * 31 + 13 * i) % 90 + 20 for i in range(length)]


def tokens_of(outputs: Sequence[GenerationOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def next_output(handle: RequestHandle, deadline: float) -> GenerationOutput:
    """The handle's next output, failing if none comes before ``deadline``
    (``time.monotonic()``)."""
    output = handle.next_output(timeout=max(0.0, deadline - time.monotonic()))
    if output is None:
        raise AssertionError(f"request {handle.request_id} sent nothing for {TIMEOUT_S:.0f} s: "
                             f"the engine hangs or never ends the request")
    return output


def first_output(handle: RequestHandle) -> GenerationOutput:
    """The first output of a request (a bounded wait)."""
    return next_output(handle, time.monotonic() + TIMEOUT_S)


def collect(handle: RequestHandle, max_tokens: int | None = None) -> list[GenerationOutput]:
    """Every output of one request, the final one last; closes the handle. Fails on a
    hang, and as soon as the request streams more than ``max_tokens`` tokens."""
    outputs: list[GenerationOutput] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            outputs.append(next_output(handle, deadline))
            streamed = len(tokens_of(outputs))
            if max_tokens is not None and streamed > max_tokens:
                raise AssertionError(f"request {handle.request_id} streamed {streamed} tokens "
                                     f"with max_tokens={max_tokens}")
            if outputs[-1].finished:
                return outputs
    finally:
        handle.close()


def run(engine: Engine, request_id: str, prompt: Sequence[int] = PROMPT,
        **sampling: object) -> list[GenerationOutput]:
    """Every output of one greedy (unless ``sampling`` says otherwise) request of 8
    tokens at most, the final one last; fails on a hang or on tokens past ``max_tokens``."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **sampling})  # type: ignore[arg-type]
    return collect(engine.submit(GenerationRequest(request_id, list(prompt), params)),
                   max_tokens=params.max_tokens)


def first_tokens(engine: Engine, name: str, seeds: Sequence[int], prompt: Sequence[int] = PROMPT,
                 **sampling: object) -> list[Hashable]:
    """What each of ``len(seeds)`` one-token requests sampled (``request.seed = seed``):
    its token id, or :data:`~omlx_core.testing.sampling_check.END` for one that ended on an end-of-sequence token. The
    requests are sent as many at a time as the engine runs at once."""
    wave = max(1, min(engine.limits().max_running, 32))
    drawn: list[Hashable] = []
    for start in range(0, len(seeds), wave):
        handles = [engine.submit(GenerationRequest(
            f"{name}-{seed}", list(prompt),
            SamplingParams(**{"max_tokens": 1, **sampling, "seed": seed})))  # type: ignore[arg-type]
            for seed in seeds[start:start + wave]]
        for handle in handles:
            outputs = collect(handle, max_tokens=1)
            final, tokens = outputs[-1], tokens_of(outputs)
            if tokens:
                drawn.append(tokens[0])
            elif final.finish_reason == "stop":
                drawn.append(END)
            else:
                raise AssertionError(f"the one-token request {handle.request_id} ended "
                                     f"{final.finish_reason!r} with no token: {final}")
    return drawn


def text_of(engine: Engine, outputs: Sequence[GenerationOutput]) -> str:
    """The text of a request's outputs, as the serving pipeline makes it."""
    processor = OutputProcessor(engine.detokenizer())
    text = "".join(processor.add(o.token_ids).text for o in outputs)
    return text + processor.finish().text


def run_until_stop(engine: Engine, request: GenerationRequest,
                   stop: str) -> tuple[str, list[GenerationOutput], OutputProcessor]:
    """What the pipeline does with a stop string: outputs through an output processor
    until the stop matches, then the request is aborted (the handle closed, as the
    pipeline does) and read to its final output. Returns the text, every output the
    engine sent, and the processor. Fails on a hang, and when the engine streams more
    than :data:`AFTER_ABORT_TOKENS` tokens after the abort."""
    handle = engine.submit(request)
    processor = OutputProcessor(engine.detokenizer(), (stop,))
    outputs: list[GenerationOutput] = []
    text: list[str] = []
    stopped_at: int | None = None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            output = next_output(handle, deadline)
            outputs.append(output)
            if stopped_at is None:
                text.append(processor.add(output.token_ids).text)
                if processor.stopped and not output.finished:
                    stopped_at = len(tokens_of(outputs))
                    handle.close()
            elif len(tokens_of(outputs)) - stopped_at > AFTER_ABORT_TOKENS:
                raise AssertionError(
                    f"the engine streamed {len(tokens_of(outputs)) - stopped_at} tokens after "
                    f"the stop string matched and the request was aborted")
            if output.finished:
                if not processor.stopped:
                    text.append(processor.finish().text)
                return "".join(text), outputs, processor
    finally:
        handle.close()


def abort_after_first_output(engine: Engine, request_id: str, *, close: bool = False,
                             prompt: Sequence[int] = PROMPT) -> tuple[list[GenerationOutput], int]:
    """Start an endless greedy request, stop it as soon as its first output arrives
    (``engine.abort``, or closing its handle as the pipeline does when ``close``), and
    read it to its final output. Returns the outputs and how many tokens came after
    the stop; fails as soon as more than :data:`AFTER_ABORT_TOKENS` did."""
    handle = engine.submit(GenerationRequest(
        request_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=ENDLESS)))
    how = "closing its handle" if close else f"abort({request_id!r})"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        outputs = [next_output(handle, deadline)]
        if outputs[0].finished:
            raise AssertionError(f"an endless request ended at its first output: {outputs[0]}")
        # What the engine streamed before the stop, waiting to be read, is not "after"
        # it: on a loaded machine this reader may get its first output many steps late.
        while (waiting := handle.next_output(timeout=0)) is not None:
            outputs.append(waiting)
            if waiting.finished:
                raise AssertionError(f"an endless request ended before it was stopped: {waiting}")
        if close:
            handle.close()
        else:
            engine.abort(request_id)
        before = len(tokens_of(outputs))
        while not outputs[-1].finished:
            outputs.append(next_output(handle, deadline))
            after = len(tokens_of(outputs)) - before
            if after > AFTER_ABORT_TOKENS:
                raise AssertionError(f"the engine streamed {after} tokens after {how} "
                                     f"and goes on")
        return outputs, len(tokens_of(outputs)) - before
    finally:
        handle.close()
