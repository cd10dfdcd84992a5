"""Serving benchmark: ``omlx-core serve`` against ``mlx_lm.server``, same model, same requests.

    omlx-core bench [--model DIR] [--quick] [--only omlx|mlx_lm] [--out FILE]

Each server runs as a subprocess on a loopback port, one after the other (never both at
once), is warmed up, then receives the same request mix: OpenAI streaming chat
completions, greedy, with the special tokens banned through ``logit_bias`` so every
stream runs to its ``max_tokens``. Measured per server:

- open-ended: aggregate tokens/s at 1, 8 and 16 concurrent streams writing stories
  (all completion tokens over the wall time from the first request to the last token);
- input-grounded: the same at 1 and 8 streams asked to return a given text with one
  word changed (an edit: the answer copies its prompt, as code edits and rewrites do);
- time to first token (TTFT), p50 and p95, for single requests and at 8 streams;
  inter-token latency (ITL, the gap between text chunks) p95 at 8 streams;
- a ~2.3k-token system prompt: cold TTFT, then the TTFT of the same request again (a
  prefix-cache hit), of the same system prompt with a new question, of the system
  prompt with one word edited in its middle, and of a multi-turn follow-up that
  re-sends the whole history;
- long-prompt arrival: the running streams' ITL (max, p99 and p95 gap) and tokens/s
  while a ~5k-token prompt is admitted beside 8 of them, and that prompt's TTFT.

The table gives both servers' figures and ours/theirs, with the better direction.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shutil
import statistics
import sys
import threading
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import (StreamRecord, chat_body, run_concurrently, special_token_ids,
                                    stream_chat)
from omlx_core.bench.prompts import text_of_tokens
from omlx_core.bench.servers import (MLX_LM, OMLX, ServerProcess, ServerSettings, ServerSpec,
                                     blas_of, free_port, fresh_cache_root, mlx_lm_spec,
                                     omlx_spec)

DEFAULT_OUT = Path("docs/bench-serving.md")
TOPICS = ("a lighthouse keeper", "a clockmaker", "a river", "a mountain village", "a robot",
          "a library at night", "a desert caravan", "an old ship", "a winter garden", "a city",
          "a beekeeper", "a glass blower", "a night train", "a chess club", "a volcano",
          "a fishing boat")


@dataclass(frozen=True)
class Plan:
    """How much of each phase to run."""

    max_tokens: int
    single_requests: int
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
        """Requests one server receives (for the progress bar)."""
        warmup = 3
        return (warmup + self.single_requests + self.rounds * sum(self.concurrency) + 5
                + self.running_streams + 1 + sum(self.grounded_concurrency))


FULL = Plan(max_tokens=128, single_requests=5, rounds=2, prefix_tokens=2300, answer_tokens=32,
            admission_prompt_tokens=5000, running_streams=8, running_max_tokens=2048,
            warmup_prompt_tokens=600)
QUICK = Plan(max_tokens=16, single_requests=2, rounds=1, prefix_tokens=300, answer_tokens=8,
             admission_prompt_tokens=600, running_streams=4, running_max_tokens=1024,
             warmup_prompt_tokens=200, grounded_text_tokens=120, grounded_max_tokens=48)


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    #: ours/theirs must be >= this (higher is better) or <= this (lower is better)
    target: float | None = None
    digits: int = 2
    #: ours alone must be <= this (seconds): a target that is not a ratio
    limit: float | None = None


METRICS = (
    Metric("tps_1", "open-ended: aggregate tokens/s, 1 stream", True, target=1.0, digits=1),
    Metric("tps_8", "open-ended: aggregate tokens/s, 8 streams", True, target=1.1, digits=1),
    Metric("tps_16", "open-ended: aggregate tokens/s, 16 streams", True, target=1.3, digits=1),
    Metric("grounded_tps_1", "input-grounded (edit a given text): tokens/s, 1 stream", True,
           target=1.8, digits=1),
    Metric("grounded_tps_8", "input-grounded (edit a given text): tokens/s, 8 streams", True,
           target=1.4, digits=1),
    Metric("ttft_1_p50", "TTFT p50, single request (s)", False, digits=3),
    Metric("ttft_1_p95", "TTFT p95, single request (s)", False, digits=3),
    Metric("ttft_8_p50", "TTFT p50, 8 streams (s)", False, digits=3),
    Metric("ttft_8_p95", "TTFT p95, 8 streams (s)", False, target=0.5, digits=3),
    Metric("itl_8_p50", "ITL p50, 8 streams (s)", False, digits=3),
    Metric("itl_8_p95", "ITL p95, 8 streams (s)", False, target=1.0, digits=3),
    Metric("prefix_cold", "shared system prompt: cold TTFT (s)", False),
    Metric("prefix_hit", "shared system prompt: same request again (prefix hit) TTFT (s)", False,
           target=0.5, digits=3),
    Metric("prefix_new_question", "shared system prompt, new question TTFT (s)", False,
           target=0.5, digits=3),
    Metric("prefix_edit", "system prompt with one word edited mid-way TTFT (s)", False,
           digits=3),
    Metric("prefix_followup", "multi-turn follow-up (whole history) TTFT (s)", False, digits=3),
    Metric("admission_ttft", "long prompt admitted beside running streams: its TTFT (s)", False),
    Metric("admission_itl_p95", "running streams' ITL p95 while the long prompt is served (s)",
           False, digits=3),
    Metric("admission_itl_p99", "running streams' ITL p99 while the long prompt is served (s)",
           False, digits=3, limit=0.6),
    Metric("admission_itl_max", "running streams' ITL max while the long prompt is served (s)",
           False, digits=3, limit=1.0),
    Metric("admission_tps", "running streams' tokens/s while the long prompt is served", True,
           target=1.0, digits=1),
    Metric("admission_itl_before", "running streams' ITL p50 before the admission (s)", False,
           digits=3),
)


@dataclass
class ServerResult:
    spec: ServerSpec
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min; {os.cpu_count()} CPUs)"


class Bench:
    """The request mix, run against one started server."""

    def __init__(self, server: ServerProcess, model_dir: Path, plan: Plan,
                 banned_token_ids: Sequence[int], progress: Any):
        self.server = server
        self.model_dir = model_dir
        self.plan = plan
        self.banned = list(banned_token_ids)
        self.progress = progress
        self.retries = 0

    def _phase(self, name: str) -> None:
        self.progress.set_description(f"{self.server.spec.name}: {name}")

    def request(self, messages: Sequence[dict[str, str]], max_tokens: int, *,
                stop: threading.Event | None = None,
                on_text: Callable[[float], None] | None = None) -> StreamRecord:
        body = chat_body(self.server.spec.model_id, messages, max_tokens, self.banned)
        record = stream_chat(self.server.host, self.server.port, body, stop=stop, on_text=on_text)
        self.retries += record.retries
        self.progress.update(1)
        if not record.chunk_times:
            raise RuntimeError(f"{self.server.spec.label} streamed no text for a request of "
                               f"max_tokens={max_tokens}; its log: {self.server.log_path}")
        return record

    def concurrent(self, messages: Sequence[Sequence[dict[str, str]]], max_tokens: int
                   ) -> tuple[list[StreamRecord], float]:
        return run_concurrently(len(messages), lambda i: self.request(messages[i], max_tokens))

    @staticmethod
    def story(tag: str, index: int) -> list[dict[str, str]]:
        topic = TOPICS[index % len(TOPICS)]
        return [{"role": "user", "content": f"Story {tag}.{index}: write a long, detailed "
                                            f"story about {topic}."}]

    def warm_up(self) -> None:
        """Compile the decode and prefill kernels and fault the weights in."""
        self._phase("warm-up")
        prefill = text_of_tokens(self.model_dir, self.plan.warmup_prompt_tokens, seed=99,
                                 heading="Background notes for the warm-up.")
        self.concurrent([self.story("warm", 0), self.story("warm", 1)], 8)
        self.request([{"role": "user", "content": prefill + "\nSummarise."}], 4)

    def throughput(self, figures: dict[str, float], notes: list[str]) -> None:
        plan = self.plan
        self._phase("1 stream")
        singles = [self.request(self.story("single", i), plan.max_tokens)
                   for i in range(plan.single_requests)]
        figures["tps_1"] = statistics.median(r.completion_tokens / (r.finished - r.started)
                                             for r in singles)
        figures["ttft_1_p50"] = percentile([r.ttft for r in singles], 50)
        figures["ttft_1_p95"] = percentile([r.ttft for r in singles], 95)
        for streams in plan.concurrency:
            self._phase(f"{streams} streams")
            rates, records = [], []
            for round_index in range(plan.rounds):
                batch, seconds = self.concurrent(
                    [self.story(f"{streams}x{round_index}", i) for i in range(streams)],
                    plan.max_tokens)
                rates.append(sum(r.completion_tokens for r in batch) / seconds)
                records += batch
            figures[f"tps_{streams}"] = statistics.median(rates)
            tokens = sum(r.completion_tokens for r in records)
            chunks = sum(len(r.chunk_times) for r in records)
            short = sum(r.completion_tokens < plan.max_tokens for r in records)
            notes.append(f"{streams} streams: {plan.rounds} round(s), {tokens} tokens in {chunks} "
                         f"text chunks ({tokens / chunks:.2f} tokens per chunk)"
                         + (f", {short} stream(s) shorter than max_tokens" if short else ""))
            if streams == 8:
                ttfts = [r.ttft for r in records]
                gaps = [g for r in records for g in r.gaps]
                figures["ttft_8_p50"] = percentile(ttfts, 50)
                figures["ttft_8_p95"] = percentile(ttfts, 95)
                figures["itl_8_p50"] = percentile(gaps, 50)
                figures["itl_8_p95"] = percentile(gaps, 95)

    def grounded(self, index: int) -> list[dict[str, str]]:
        """A request whose answer copies its prompt: return a given text, one word changed."""
        text = text_of_tokens(self.model_dir, self.plan.grounded_text_tokens, seed=31 + index % 4,
                              heading="Harbour rules, draft 3.")
        return [{"role": "user", "content": f"{text}\n\nReturn the text above exactly as it is, "
                                            "word for word, but write 'harbour' as 'port'."}]

    def input_grounded(self, figures: dict[str, float], notes: list[str]) -> None:
        plan = self.plan
        for streams in plan.grounded_concurrency:
            self._phase(f"input-grounded, {streams} stream(s)")
            batch, seconds = self.concurrent([self.grounded(i) for i in range(streams)],
                                             plan.grounded_max_tokens)
            figures[f"grounded_tps_{streams}"] = sum(r.completion_tokens for r in batch) / seconds
            tokens = sum(r.completion_tokens for r in batch)
            notes.append(f"input-grounded, {streams} stream(s): ~{plan.grounded_text_tokens}-token "
                         f"text to return edited, {tokens} tokens in {seconds:.1f} s")

    def shared_prefix(self, figures: dict[str, float], notes: list[str]) -> None:
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
        notes.append(f"shared prefix: {described}")

    def admission(self, figures: dict[str, float], notes: list[str]) -> None:
        """Running streams' gaps while a long prompt is prefilled beside them."""
        self._phase("long-prompt admission")
        plan = self.plan
        stop = threading.Event()
        counts = [0] * plan.running_streams
        decoding = threading.Condition()

        def counter(index: int) -> Callable[[float], None]:
            def seen(_: float) -> None:
                with decoding:
                    counts[index] += 1
                    decoding.notify_all()
            return seen

        records: list[StreamRecord | BaseException | None] = [None] * plan.running_streams

        def run(index: int) -> None:
            try:
                records[index] = self.request(self.story("running", index),
                                              plan.running_max_tokens, stop=stop,
                                              on_text=counter(index))
            except BaseException as exc:  # reported below, with the stream it came from
                records[index] = exc
                with decoding:
                    decoding.notify_all()

        threads = [threading.Thread(target=run, args=(i,), daemon=True)
                   for i in range(plan.running_streams)]
        for thread in threads:
            thread.start()
        # Admit the long prompt only once every running stream is past its prefill.
        with decoding:
            decoding.wait_for(lambda: all(c >= 3 for c in counts)
                              or any(isinstance(r, BaseException) for r in records))
        long_prompt = text_of_tokens(self.model_dir, plan.admission_prompt_tokens, seed=11,
                                     heading="Here is the maintenance log of the harbour:")
        try:
            admitted = self.request([{"role": "user",
                                      "content": long_prompt + "\nWhat went wrong most often?"}],
                                    4)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        for index, record in enumerate(records):
            if not isinstance(record, StreamRecord):
                raise RuntimeError(f"running stream {index} failed: {record!r}")
        # The window runs until the long prompt is served: its prefill, and the steps it
        # decodes beside the running streams (joining their batch, then leaving it).
        window_start, window_end = admitted.started, admitted.finished
        running = [r for r in records if isinstance(r, StreamRecord)]
        during = [b - a for r in running for a, b in zip(r.chunk_times, r.chunk_times[1:])
                  if b > window_start and a < window_end]
        before = [b - a for r in running for a, b in zip(r.chunk_times, r.chunk_times[1:])
                  if b <= window_start]
        inside = sum(window_start < t <= window_end for r in running for t in r.chunk_times)
        ended = sum(r.complete for r in running)
        figures["admission_ttft"] = admitted.ttft
        figures["admission_itl_p95"] = percentile(during, 95)
        figures["admission_itl_p99"] = percentile(during, 99)
        figures["admission_itl_max"] = max(during, default=math.nan)
        figures["admission_tps"] = inside / (window_end - window_start)
        figures["admission_itl_before"] = percentile(before, 50)
        notes.append(f"admission: {admitted.prompt_tokens}-token prompt beside "
                     f"{plan.running_streams} running streams, {len(during)} gaps in the window"
                     + (f"; {ended} running stream(s) ended before the window closed" if ended
                        else ""))


def measure(spec: ServerSpec, port: int, model_dir: Path, plan: Plan,
            banned: Sequence[int]) -> ServerResult:
    """Start one server, warm it up, run every phase, stop it."""
    from tqdm import tqdm

    result = ServerResult(spec)
    result.notes.append(f"load average before start: {_load_average()}")
    with ServerProcess(spec, port) as server, tqdm(total=plan.requests, unit="req",
                                                   desc=spec.name, file=sys.stderr) as progress:
        result.notes.append(f"BLAS mapped in the server process: {blas_of(server.pid)}")
        bench = Bench(server, model_dir, plan, banned, progress)
        bench.warm_up()
        # A failed phase leaves its figures out and the report says why; the others run.
        for phase in (bench.throughput, bench.input_grounded, bench.shared_prefix,
                      bench.admission):
            try:
                phase(result.figures, result.notes)
            except Exception as exc:
                result.notes.append(f"FAILED {phase.__name__}: {exc!r} (server log: "
                                    f"{server.log_path})")
                progress.write(f"{spec.label}: {phase.__name__} failed: {exc!r}; its log "
                               f"({server.log_path}) ends:\n{server.log_tail()}")
        if bench.retries:
            result.notes.append(f"{bench.retries} request(s) sent again after the server dropped "
                                "the connection before answering")
    return result


def _format(value: float | None, digits: int) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def render(results: Sequence[ServerResult], header: Sequence[str]) -> str:
    """The markdown report: header lines, the comparison table, per-server notes."""
    ours = next((r for r in results if r.spec.name == OMLX), None)
    theirs = next((r for r in results if r.spec.name == MLX_LM), None)
    lines = ["## Serving benchmark: omlx-core vs mlx_lm.server", "", *header, ""]
    lines += ["| metric | better | omlx-core | mlx_lm.server | ours / theirs | target |",
              "|---|---|---:|---:|---:|---|"]
    for metric in METRICS:
        mine = ours.figures.get(metric.key) if ours else None
        other = theirs.figures.get(metric.key) if theirs else None
        ratio = mine / other if mine is not None and other else None
        target = ""
        if metric.limit is not None:
            target = f"<= {metric.limit:g} s"
            if mine is not None and not math.isnan(mine):
                target += " met" if mine <= metric.limit else " MISSED"
        elif metric.target is not None:
            sign = ">=" if metric.higher_is_better else "<="
            target = f"{sign} {metric.target:g}x"
            if ratio is not None and not math.isnan(ratio):
                met = ratio >= metric.target if metric.higher_is_better else ratio <= metric.target
                target += " met" if met else " MISSED"
        lines.append(f"| {metric.label} | {'higher' if metric.higher_is_better else 'lower'} | "
                     f"{_format(mine, metric.digits)} | {_format(other, metric.digits)} | "
                     f"{_format(ratio, 2)} | {target} |")
    for result in results:
        lines += ["", f"**{result.spec.label}** (`{' '.join(_short_argv(result.spec.argv))}`)", ""]
        lines += [f"- {note}" for note in result.notes]
        lines += [f"- lacks {item}" for item in result.spec.lacks]
    return "\n".join(lines) + "\n"


def _short_argv(argv: Sequence[str]) -> list[str]:
    """The command as a reader can run it: ``python`` for this interpreter, ``~`` for the
    home directory (a committed report shows no machine's paths)."""
    home = str(Path.home())
    return ["python" if arg == sys.executable else
            ("~" + arg[len(home):] if arg.startswith(home + os.sep) else arg) for arg in argv]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path,
                        help="an mlx-lm model directory (default: the embedded default model, "
                             "served exactly as `./setup.sh serve` serves it)")
    parser.add_argument("--tier",
                        help="omlx-core tier (default: the one `omlx-core serve` picks for this "
                             "machine); its batch and prefill settings go to both servers")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an omlx-core setting override, printed in the report (the batch "
                             "and prefill settings also go to mlx_lm.server)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: few tokens, short prompts, one round")
    parser.add_argument("--only", choices=(OMLX, MLX_LM), help="measure one server only")
    parser.add_argument("--out", type=Path,
                        help=f"write the markdown table here (default {DEFAULT_OUT}; "
                             "with --quick, nothing is written unless --out is given)")


def settings_for(tier: str | None, overrides: Sequence[str]) -> ServerSettings:
    """omlx-core's effective settings for this run: the tier ``serve`` would pick (or the
    one given) and the given overrides, nothing else."""
    from omlx_core.bootstrap import load_setup
    from omlx_core.config import parse_set_flag
    from omlx_core.http.serve import SPARE_THREADS

    config = load_setup(tier, [], [(*parse_set_flag(o), f"bench --set {o}")
                                   for o in overrides]).config
    max_batch = int(config["plugin.batched.max_batch_size"])
    threads = config["server.threads"]
    if threads == "auto":
        threads = max_batch + int(config["memory.queue_size"]) + SPARE_THREADS
    return ServerSettings(tier=config.tier, max_batch_size=max_batch,
                          prefill_step_size=int(config["plugin.batched.prefill_step_size"]),
                          http_threads=int(threads), overrides=tuple(overrides),
                          tier_given=tier is not None)


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    model_dir = args.model
    served_id = None
    if model_dir is None:
        from omlx_core.config import load_config
        from omlx_core.models.default import ensure_default_model

        model_dir = ensure_default_model()
        served_id = load_config(args.tier)["server.models"][0]
    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} is not an mlx-lm model directory (no config.json)")
    settings = settings_for(args.tier, args.set)
    banned = special_token_ids(model_dir)
    # Prompts repeat from run to run: blocks an earlier run left in the SSD cache would
    # turn this run's cold prefills into hits.
    cache_root = fresh_cache_root()
    specs = []
    if args.only in (None, OMLX):
        specs.append(lambda port: omlx_spec(None if served_id else model_dir, port, settings,
                                            served_id, cache_root))
    if args.only in (None, MLX_LM):
        specs.append(lambda port: mlx_lm_spec(model_dir, port, settings))
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {'--quick' if args.quick else 'full run'}",
        f"- load average before the run (`uptime`): {_load_average()}",
        f"- model `{model_dir.name}`; mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}, "
        f"omlx-core {_version('omlx-core')}",
        f"- omlx-core started as `./setup.sh serve` starts it: tier `{settings.tier}` "
        f"({'given' if settings.tier_given else 'picked for this machine'}), "
        f"{settings.http_threads} HTTP threads; overrides: "
        f"{', '.join(f'`{o}`' for o in settings.overrides) or 'none'}; `OMLX_CACHE_DIR` a "
        f"new directory (its `models/` linked to the user's), so the SSD cache starts empty "
        f"as on a first start",
        f"- both servers: max batch {settings.max_batch_size}, prefill step "
        f"{settings.prefill_step_size} (mlx_lm.server given omlx-core's values)",
        f"- requests: streaming chat completions, greedy, special tokens banned by logit_bias "
        f"so each stream runs to max_tokens; {plan.max_tokens} tokens per stream, "
        f"{plan.single_requests} single requests, {plan.rounds} round(s) at each of "
        f"{', '.join(map(str, plan.concurrency))} streams; input-grounded: a "
        f"~{plan.grounded_text_tokens}-token text returned with one word changed, "
        f"{plan.grounded_max_tokens} tokens per stream at "
        f"{', '.join(map(str, plan.grounded_concurrency))} stream(s); ~{plan.prefix_tokens}-token shared "
        f"system prompt ({plan.answer_tokens}-token answers); "
        f"{plan.admission_prompt_tokens}-token prompt admitted beside "
        f"{plan.running_streams} running streams",
        "- TTFT: request sent to first text chunk; ITL: gap between text chunks; tokens/s: "
        "completion tokens (server's usage) over wall time, first request to last token",
    ]
    results = []
    for make_spec in specs:
        port = free_port()
        results.append(measure(make_spec(port), port, model_dir, plan, banned))
    report = render(results, header)
    publish_report(report, args.out if args.out is not None else (None if args.quick else DEFAULT_OUT))
    shutil.rmtree(cache_root, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omlx_core.bench.serving",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
