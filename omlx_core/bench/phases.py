"""The serving benchmark's request mix, run against one started server (:class:`Bench`).

Every request is a streaming chat completion, greedy, with no ``logit_bias``: an answer
ends where the model ends it or at ``max_tokens``, and rates count the tokens each
server's usage reports. Each phase writes figures (by :class:`~.report.Metric` key) and
notes for one round; the orchestration in :mod:`.serving` runs each phase on every
server in turn.
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from omlx_core.bench.client import StreamRecord, chat_body, run_concurrently, stream_chat
from omlx_core.bench.prompts import OPEN_ENDED, repeated_share, text_of_tokens
from omlx_core.bench.servers import ServerProcess

TOPICS = ("a lighthouse keeper", "a clockmaker", "a river", "a mountain village", "a robot",
          "a library at night", "a desert caravan", "an old ship", "a winter garden", "a city",
          "a beekeeper", "a glass blower", "a night train", "a chess club", "a volcano",
          "a fishing boat")


@dataclass(frozen=True)
class Plan:
    """How much of each phase to run."""

    #: most tokens of an open-ended answer
    max_tokens: int
    #: open-ended prompts sent one at a time per round, the first one as the server's
    #: first request after it is ready
    single_requests: int
    #: alternating rounds (each server started afresh in each)
    rounds: int
    prefix_tokens: int
    answer_tokens: int
    admission_prompt_tokens: int
    running_streams: int
    running_max_tokens: int
    #: a warm-up prompt over a few prefill chunks compiles the prefill kernels
    warmup_prompt_tokens: int
    #: tokens of the text the input-grounded requests return edited, and of their answers
    grounded_text_tokens: int = 300
    grounded_max_tokens: int = 256
    concurrency: tuple[int, ...] = (8, 16)
    grounded_concurrency: tuple[int, ...] = (1, 8)

    @property
    def requests(self) -> int:
        """Requests one server with every phase receives in one round (a progress bar's
        total; the admission phase may send a few more)."""
        warmup = 3
        return (warmup + self.single_requests + sum(self.concurrency) + 5
                + self.running_streams + 1 + sum(self.grounded_concurrency))


FULL = Plan(max_tokens=128, single_requests=8, rounds=3, prefix_tokens=2300, answer_tokens=32,
            admission_prompt_tokens=5000, running_streams=8, running_max_tokens=512,
            warmup_prompt_tokens=600)
QUICK = Plan(max_tokens=16, single_requests=2, rounds=1, prefix_tokens=300, answer_tokens=8,
             admission_prompt_tokens=600, running_streams=4, running_max_tokens=64,
             warmup_prompt_tokens=200, grounded_text_tokens=120, grounded_max_tokens=48)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def batch_decode_rate(records: Sequence[StreamRecord]) -> float:
    """Concurrent streams' decode rate: the tokens after each stream's first, over the
    span from the earliest first token to the latest last one."""
    first = min(r.chunk_times[0] for r in records)
    last = max(r.chunk_times[-1] for r in records)
    tokens = sum(r.completion_tokens - 1 for r in records)
    return tokens / (last - first) if last > first else math.nan


@dataclass
class Drafts:
    """Completion, drafted and accepted tokens a phase's usage reported, over every round."""

    completion: int = 0
    drafted: int = 0
    accepted: int = 0
    #: requests whose usage carried no drafts (a server that drafted nothing for them,
    #: or one that reports none)
    unreported: int = 0
    requests: int = 0

    def add(self, record: StreamRecord) -> None:
        self.requests += 1
        self.completion += record.completion_tokens
        if record.draft_tokens is None:
            self.unreported += 1
        else:
            self.drafted += record.draft_tokens
            self.accepted += record.accepted_draft_tokens or 0


@dataclass
class Observations:
    """What the report shows beside the figures, gathered over every round."""

    #: the text of every answer, by (round, phase, prompt): compared across servers
    answers: dict[tuple[int, str, str], str] = field(default_factory=dict)
    drafts: dict[str, Drafts] = field(default_factory=dict)
    #: repeated word 4-gram shares of the one-stream answers, by prompt kind
    repetition: dict[str, list[float]] = field(default_factory=dict)


class Bench:
    """The request mix, run against one started server.

    :param banned_token_ids: token ids sent with a ``logit_bias`` of -100 (every stream
        then runs to its ``max_tokens``); empty for a comparison between servers (see
        :func:`~.client.chat_body`).
    """

    def __init__(self, server: ServerProcess, model_dir: Path, plan: Plan,
                 banned_token_ids: Sequence[int] = (), progress: Any = None,
                 observations: Observations | None = None):
        self.server = server
        self.model_dir = model_dir
        self.plan = plan
        self.banned = list(banned_token_ids)
        self.progress = progress
        self.observations = observations if observations is not None else Observations()
        self.round = 0
        self.retries = 0
        self.first: StreamRecord | None = None

    def _phase(self, name: str) -> None:
        if self.progress is not None:
            self.progress.set_description(f"{self.server.spec.name}: {name}")

    def request(self, messages: Sequence[dict[str, str]], max_tokens: int, *,
                stop: threading.Event | None = None,
                on_text: Callable[[float], None] | None = None) -> StreamRecord:
        body = chat_body(self.server.spec.model_id, messages, max_tokens, self.banned)
        record = stream_chat(self.server.host, self.server.port, body, stop=stop, on_text=on_text)
        self.retries += record.retries
        if self.progress is not None:
            self.progress.update(1)
        if not record.chunk_times:
            raise RuntimeError(f"{self.server.spec.label} streamed no text for a request of "
                               f"max_tokens={max_tokens}; its log: {self.server.log_path}")
        return record

    def concurrent(self, messages: Sequence[Sequence[dict[str, str]]], max_tokens: int
                   ) -> tuple[list[StreamRecord], float]:
        return run_concurrently(len(messages), lambda i: self.request(messages[i], max_tokens))

    def _observe(self, phase: str, prompts: Sequence[str], records: Sequence[StreamRecord]) -> None:
        drafts = self.observations.drafts.setdefault(phase, Drafts())
        for prompt, record in zip(prompts, records):
            self.observations.answers[(self.round, phase, prompt)] = record.text
            drafts.add(record)

    @staticmethod
    def story(tag: str, index: int) -> list[dict[str, str]]:
        """A story request with a tag of its own (the developer benchmarks' open-ended
        request)."""
        topic = TOPICS[index % len(TOPICS)]
        return [{"role": "user", "content": f"Story {tag}.{index}: write a long, detailed "
                                            f"story about {topic}."}]

    @staticmethod
    def open_ended(index: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": OPEN_ENDED[index % len(OPEN_ENDED)].text}]

    # -- phases ------------------------------------------------------------------------

    def first_request(self, figures: dict[str, float], notes: dict[str, str]) -> None:
        """The server's first request once it answers: the first open-ended prompt, as a
        user's first question would come (before any warm-up)."""
        self._phase("first request")
        record = self.request(self.open_ended(0), self.plan.max_tokens)
        self.first = record
        figures["first_ttft"] = record.ttft
        figures["first_seconds"] = record.finished - record.started
        notes["first"] = (f"first request after ready: {record.completion_tokens} tokens, "
                          f"TTFT {record.ttft:.3f} s, {record.finished - record.started:.2f} s "
                          "end to end")

    def warm_up(self) -> None:
        """Compile the decode and prefill kernels and fault the weights in."""
        self._phase("warm-up")
        prefill = text_of_tokens(self.model_dir, self.plan.warmup_prompt_tokens, seed=99,
                                 heading="Background notes for the warm-up.")
        self.concurrent([self.story("warm", 0), self.story("warm", 1)], 8)
        self.request([{"role": "user", "content": prefill + "\nSummarise."}], 4)

    def single_stream(self, figures: dict[str, float], notes: dict[str, str]) -> None:
        """The open-ended prompts one at a time (the first request after ready among
        them, when it was sent)."""
        plan = self.plan
        self._phase("1 stream")
        records = [self.first] if self.first is not None else []
        for index in range(len(records), plan.single_requests):
            records.append(self.request(self.open_ended(index), plan.max_tokens))
        kinds = [OPEN_ENDED[i % len(OPEN_ENDED)].kind for i in range(len(records))]
        self._observe("1 stream", [OPEN_ENDED[i % len(OPEN_ENDED)].text
                                   for i in range(len(records))], records)
        figures["tps_1"] = statistics.median(r.end_to_end_rate for r in records)
        figures["decode_1"] = statistics.median(_finite(r.decode_rate for r in records))
        for kind in ("question", "story"):
            of_kind = [r for r, k in zip(records, kinds) if k == kind]
            if of_kind:
                figures[f"decode_1_{kind}"] = statistics.median(_finite(
                    r.decode_rate for r in of_kind))
                self.observations.repetition.setdefault(kind, []).extend(
                    repeated_share(r.text) for r in of_kind)
        figures["ttft_1_p50"] = percentile([r.ttft for r in records], 50)
        figures["ttft_1_p95"] = percentile([r.ttft for r in records], 95)
        notes["1 stream"] = (f"1 stream: {len(records)} requests, "
                             f"{sum(r.completion_tokens for r in records)} tokens, "
                             f"{_stopped(records, plan.max_tokens)}")

    def streams(self, count: int, figures: dict[str, float], notes: dict[str, str]) -> None:
        """``count`` open-ended prompts at once."""
        self._phase(f"{count} streams")
        records, seconds = self.concurrent([self.open_ended(i) for i in range(count)],
                                           self.plan.max_tokens)
        self._observe(f"{count} streams", [OPEN_ENDED[i % len(OPEN_ENDED)].text
                                           for i in range(count)], records)
        tokens = sum(r.completion_tokens for r in records)
        figures[f"tps_{count}"] = tokens / seconds
        figures[f"decode_{count}"] = batch_decode_rate(records)
        chunks = sum(len(r.chunk_times) for r in records)
        notes[f"{count} streams"] = (
            f"{count} streams: {tokens} tokens in {chunks} text chunks "
            f"({tokens / chunks:.2f} tokens per chunk), {_stopped(records, self.plan.max_tokens)}")
        if count == 8:
            gaps = [g for r in records for g in r.gaps]
            figures["ttft_8_p50"] = percentile([r.ttft for r in records], 50)
            figures["ttft_8_p95"] = percentile([r.ttft for r in records], 95)
            figures["itl_8_p50"] = percentile(gaps, 50)
            figures["itl_8_p95"] = percentile(gaps, 95)

    def grounded(self, index: int) -> list[dict[str, str]]:
        """A request whose answer copies its prompt: return a given text, one word changed."""
        text = text_of_tokens(self.model_dir, self.plan.grounded_text_tokens, seed=31 + index % 4,
                              heading="Harbour rules, draft 3.")
        return [{"role": "user", "content": f"{text}\n\nReturn the text above exactly as it is, "
                                            "word for word, but write 'harbour' as 'port'."}]

    def input_grounded(self, figures: dict[str, float], notes: dict[str, str]) -> None:
        plan = self.plan
        for count in plan.grounded_concurrency:
            self._phase(f"input-grounded, {count} stream(s)")
            records, seconds = self.concurrent([self.grounded(i) for i in range(count)],
                                               plan.grounded_max_tokens)
            self._observe(f"grounded {count}", [f"grounded {i % 4}" for i in range(count)],
                          records)
            tokens = sum(r.completion_tokens for r in records)
            figures[f"grounded_tps_{count}"] = tokens / seconds
            figures[f"grounded_decode_{count}"] = batch_decode_rate(records)
            notes[f"grounded {count}"] = (
                f"input-grounded, {count} stream(s): ~{plan.grounded_text_tokens}-token text to "
                f"return edited, {tokens} tokens in {seconds:.1f} s, "
                f"{_stopped(records, plan.grounded_max_tokens)}")

    def shared_prefix(self, figures: dict[str, float], notes: dict[str, str]) -> None:
        self._phase("shared prefix")
        plan = self.plan
        system = {"role": "system", "content": text_of_tokens(
            self.model_dir, plan.prefix_tokens, seed=7,
            heading="You are the operations assistant of a small harbour town. "
                    "Apply these rules when you answer:")}
        first_turn = {"role": "user", "content": "Which rules mention the ferry crew?"}
        cold = self.request([system, first_turn], plan.answer_tokens)
        hit = self.request([system, first_turn], plan.answer_tokens)
        question = self.request([system, {"role": "user",
                                          "content": "What must happen before the first bell?"}],
                                plan.answer_tokens)
        words = system["content"].split(" ")
        words[len(words) // 2] = "lighthouse"
        edited = self.request([{"role": "system", "content": " ".join(words)}, first_turn],
                              plan.answer_tokens)
        followup = self.request([system, first_turn, {"role": "assistant", "content": cold.text},
                                 {"role": "user", "content": "And during the spring fair?"}],
                                plan.answer_tokens)
        figures["prefix_cold"] = cold.ttft
        figures["prefix_hit"] = hit.ttft
        figures["prefix_new_question"] = question.ttft
        figures["prefix_edit"] = edited.ttft
        figures["prefix_followup"] = followup.ttft
        described = ", ".join(
            f"{name} {r.prompt_tokens} prompt tokens ({r.cached_tokens} cached)"
            if r.cached_tokens is not None else f"{name} {r.prompt_tokens} prompt tokens"
            for name, r in (("cold", cold), ("hit", hit), ("new question", question),
                            ("edit", edited), ("follow-up", followup)))
        notes["shared prefix"] = f"shared prefix: {described}"

    def admission(self, figures: dict[str, float], notes: dict[str, str]) -> None:
        """Running streams' gaps while a long prompt is prefilled beside them. A running
        stream whose answer ends is followed by the next prompt on its slot, so that
        ``running_streams`` decode through the whole window."""
        self._phase("long-prompt admission")
        plan = self.plan
        stop = threading.Event()
        started = [0] * plan.running_streams
        decoding = threading.Condition()
        records: list[list[StreamRecord]] = [[] for _ in range(plan.running_streams)]
        failures: list[BaseException] = []

        def slot(index: int) -> None:
            def seen(_: float) -> None:
                with decoding:
                    started[index] += 1
                    decoding.notify_all()

            turn = 0
            while not stop.is_set():
                prompt = self.open_ended(index + turn * plan.running_streams)
                try:
                    record = self.request(prompt, plan.running_max_tokens, stop=stop,
                                          on_text=seen)
                except BaseException as exc:  # reported below, with the slot it came from
                    if not stop.is_set():  # (one hung up before its first text is no failure)
                        failures.append(exc)
                        with decoding:
                            decoding.notify_all()
                    return
                records[index].append(record)
                turn += 1

        threads = [threading.Thread(target=slot, args=(i,), daemon=True)
                   for i in range(plan.running_streams)]
        for thread in threads:
            thread.start()
        # Admit the long prompt only once every running stream is past its prefill.
        with decoding:
            decoding.wait_for(lambda: all(c >= 3 for c in started) or bool(failures))
        long_prompt = text_of_tokens(self.model_dir, plan.admission_prompt_tokens, seed=11,
                                     heading="Here is the maintenance log of the harbour:")
        try:
            if failures:
                raise RuntimeError(f"a running stream failed: {failures[0]!r}")
            admitted = self.request([{"role": "user",
                                      "content": long_prompt + "\nWhat went wrong most often?"}],
                                    4)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        if failures:
            raise RuntimeError(f"a running stream failed: {failures[0]!r}")
        # The window runs until the long prompt is served: its prefill, and the steps it
        # decodes beside the running streams (joining their batch, then leaving it).
        window_start, window_end = admitted.started, admitted.finished
        running = [r for slot_records in records for r in slot_records]
        during = [b - a for r in running for a, b in zip(r.chunk_times, r.chunk_times[1:])
                  if b > window_start and a < window_end]
        before = [b - a for r in running for a, b in zip(r.chunk_times, r.chunk_times[1:])
                  if b <= window_start]
        inside = sum(window_start < t <= window_end for r in running for t in r.chunk_times)
        followers = sum(window_start < r.started < window_end for r in running)
        figures["admission_ttft"] = admitted.ttft
        figures["admission_itl_p95"] = percentile(during, 95)
        figures["admission_itl_p99"] = percentile(during, 99)
        figures["admission_itl_max"] = max(during, default=math.nan)
        figures["admission_tps"] = inside / (window_end - window_start)
        figures["admission_itl_before"] = percentile(before, 50)
        notes["admission"] = (
            f"admission: {admitted.prompt_tokens}-token prompt beside {plan.running_streams} "
            f"running streams, {len(during)} gaps in the window, {followers} answer(s) that "
            "followed an ended one on its slot inside it")


def _finite(values: Any) -> list[float]:
    kept = [v for v in values if not math.isnan(v)]
    return kept or [math.nan]


def _stopped(records: Sequence[StreamRecord], max_tokens: int) -> str:
    """How many answers the model ended itself (the rest reached ``max_tokens``)."""
    ended = sum(r.finish_reason == "stop" for r in records)
    return f"{ended} of {len(records)} ended by the model before {max_tokens} tokens"
