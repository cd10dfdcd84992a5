"""Serving benchmark: ``omlx-core serve`` against ``mlx_lm.server``, same model, same requests.

    omlx-core bench [--model DIR] [--quick] [--rounds N] [--only omlx|mlx_lm] [--out FILE]

Three servers take part: omlx-core started as the README starts it (no flag but the
port), the same with ``plugin.batched.speculation=false`` (the open-ended phases only,
to show what speculation adds), and ``mlx_lm.server`` given omlx-core's batch and
prefill sizes. In each round every server is started afresh, in an order rotated from
round to round; each gets its first request as soon as it answers (measured: what a
user's first question pays), then a warm-up, then each phase runs on every server in
turn, with the machine quiet (no server busy) before each. Requests are OpenAI
streaming chat completions, greedy, with no ``logit_bias`` (a server pays for one as it
applies logits processors, and not every server alike): an answer ends where the model
ends it, and rates count the tokens each server's usage reports. Measured per server and
round (phases in :mod:`.phases`, figures in :mod:`.report`):

- the first request after ready: its TTFT and end-to-end time;
- open-ended: 1 stream (a fixed set of questions and stories, one at a time), 8 and 16
  concurrent streams: tokens/s end to end (first request sent to last token) and decode
  tokens/s (first token to last); each as a share of the machine's weight-streaming
  bound (:mod:`.bound`);
- input-grounded: the same at 1 and 8 streams asked to return a given text with one
  word changed (an edit: the answer copies its prompt, as code edits and rewrites do);
- time to first token (TTFT) p50 and p95 at 1 and 8 streams; inter-token latency (ITL,
  the gap between text chunks) at 8 streams;
- a ~2.3k-token system prompt: cold TTFT, then the TTFT of the same request again (a
  prefix-cache hit), of the same system prompt with a new question, of the system
  prompt with one word edited in its middle, and of a multi-turn follow-up;
- long-prompt arrival: the running streams' ITL (max, p99, p95) and tokens/s while a
  ~5k-token prompt is admitted beside 8 of them, and that prompt's TTFT.

The report gives each server's median over the rounds, the median of the per-round
ratios and their range, the drafted and accepted tokens each server's usage reported,
and how many answers were word for word the same.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import sys
from dataclasses import dataclass, replace
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.bound import Bound, measure_bound
from omlx_core.bench.phases import FULL, QUICK, Bench, Plan, percentile
from omlx_core.bench.report import METRICS, OMLX_NO_SPECULATION, ServerRun, render
from omlx_core.bench.servers import (MLX_LM, OMLX, ServerProcess, ServerSettings, ServerSpec, blas_of,
                                     free_port, fresh_cache_root, mlx_lm_spec, omlx_spec,
                                     preload_env, wait_quiet)

__all__ = ["FULL", "QUICK", "METRICS", "Bench", "Plan", "add_arguments", "main", "percentile",
           "run", "settings_for"]

DEFAULT_OUT = Path("docs/bench-serving.md")
SPECULATION_OFF = "plugin.batched.speculation=false"


@dataclass(frozen=True)
class Contender:
    """A server configuration: how to start it and which phases it runs."""

    name: str
    make_spec: Callable[[int], ServerSpec]
    #: whether it runs every phase (or only the open-ended ones)
    every_phase: bool = True


def _load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min; {os.cpu_count()} CPUs)"


def _phases(bench: Bench, every_phase: bool) -> list[tuple[str, Callable]]:
    """The phases in the order every server runs them (after its first request and its
    warm-up)."""
    plan = bench.plan
    phases: list[tuple[str, Callable]] = [("1 stream", bench.single_stream)]
    phases += [(f"{n} streams", partial(bench.streams, n)) for n in plan.concurrency]
    if every_phase:
        phases += [("input-grounded", bench.input_grounded), ("shared prefix", bench.shared_prefix),
                   ("admission", bench.admission)]
    return phases


def run_round(index: int, contenders: Sequence[Contender], runs: dict[str, ServerRun],
              model_dir: Path, plan: Plan, progress) -> None:
    """One round: every contender started afresh in a rotated order, its first request
    and warm-up, then each phase on each contender in turn; every one stopped."""
    shift = index % len(contenders)
    order = list(contenders[shift:]) + list(contenders[:shift])
    with contextlib.ExitStack() as stack:
        benches: dict[str, Bench] = {}
        figures: dict[str, dict[str, float]] = {}
        notes: dict[str, dict[str, str]] = {}
        for contender in order:
            port = free_port()
            spec = contender.make_spec(port)
            load = _load_average()
            server = stack.enter_context(ServerProcess(spec, port))
            result = runs.setdefault(contender.name, ServerRun(spec))
            if not result.facts:
                result.facts.append(f"BLAS mapped in the server process: {blas_of(server.pid)}")
            bench = Bench(server, model_dir, plan, (), progress, result.observations)
            bench.round = index
            benches[contender.name] = bench
            figures[contender.name] = {}
            notes[contender.name] = {"load": f"load average before start: {load}"}
            _attempt(bench, "first request", lambda f, n, b=bench: b.first_request(f, n),
                     figures[contender.name], notes[contender.name])
            bench.warm_up()
        pids = [bench.server.pid for bench in benches.values()]
        phase_lists = {c.name: _phases(benches[c.name], c.every_phase) for c in order}
        for step in range(max(len(p) for p in phase_lists.values())):
            for contender in order:
                phases = phase_lists[contender.name]
                if step >= len(phases):
                    continue
                name, phase = phases[step]
                if not wait_quiet(pids):
                    notes[contender.name][f"busy {name}"] = (
                        f"{name}: the servers were still busy after 60 s of waiting")
                _attempt(benches[contender.name], name, phase, figures[contender.name],
                         notes[contender.name])
        for contender in order:
            bench = benches[contender.name]
            if bench.retries:
                notes[contender.name]["retries"] = (
                    f"{bench.retries} request(s) sent again after the server dropped the "
                    "connection before answering")
            runs[contender.name].rounds.append(figures[contender.name])
            runs[contender.name].notes.append(notes[contender.name])


def _attempt(bench: Bench, name: str, phase: Callable, figures: dict[str, float],
             notes: dict[str, str]) -> None:
    """Run a phase; a failed one leaves its figures out and the report says why."""
    try:
        phase(figures, notes)
    except Exception as exc:
        notes[f"failed {name}"] = f"FAILED {name}: {exc!r} (server log: {bench.server.log_path})"
        message = (f"{bench.server.spec.label}: {name} failed: {exc!r}; its log "
                   f"({bench.server.log_path}) ends:\n{bench.server.log_tail()}")
        if bench.progress is not None:
            bench.progress.write(message)
        else:
            print(message, file=sys.stderr)


def add_bound_shares(runs: dict[str, ServerRun], bound: Bound) -> None:
    """Each round's decode rates at 1 and 16 streams as shares of the bound."""
    for run in runs.values():
        for figures in run.rounds:
            for rows in (1, 16):
                rate = figures.get(f"decode_{rows}")
                if rate is not None and rows in bound.seconds:
                    figures[f"bound_{rows}"] = rate / bound.tokens_per_s(rows)


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
    parser.add_argument("--rounds", type=int,
                        help=f"alternating rounds (default {FULL.rounds}; --quick: "
                             f"{QUICK.rounds})")
    parser.add_argument("--only", choices=(OMLX, MLX_LM),
                        help="measure one side only (omlx: with and without speculation)")
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


def _header(args: argparse.Namespace, plan: Plan, model_dir: Path, settings: ServerSettings,
            bound: Bound, load_before: str) -> list[str]:
    overrides = ", ".join(f"`{o}`" for o in settings.overrides) or "none"
    return [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {'--quick' if args.quick else 'full run'}, {plan.rounds} "
        "round(s)",
        f"- load average (`uptime`) before the run: {load_before}; after: {_load_average()}",
        f"- model `{model_dir.name}`; mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}, "
        f"waitress {_version('waitress')}, omlx-core {_version('omlx-core')}",
        f"- omlx-core started as `./setup.sh serve` starts it (`omlx-core serve`, only the port "
        f"added): tier `{settings.tier}` ({'given' if settings.tier_given else 'picked for this machine'}), "
        f"{settings.http_threads} HTTP threads; overrides: {overrides}; `OMLX_CACHE_DIR` a new "
        "directory per server and round (its `models/` and `cpu-kernels/` linked to the user's, "
        "as `setup.sh` leaves them), so the SSD cache starts empty as on a first start. Its "
        "speculation-off twin adds "
        f"`--set {SPECULATION_OFF}` and runs the open-ended phases only",
        f"- mlx_lm.server given omlx-core's max batch ({settings.max_batch_size}: "
        f"`--decode-concurrency`, `--prompt-concurrency`) and prefill step "
        f"({settings.prefill_step_size}: `--prefill-step-size`)",
        f"- weight-streaming bound (one matmul of the model's size, timed on this machine "
        f"two ways in the servers' environment before every round, the fastest counting): "
        f"{bound.describe()}",
        "- rounds: every server started afresh each round, in an order rotated from round to "
        "round; its first request sent as soon as it answers `GET /v1/models`, then a "
        "warm-up; then each phase on every server in turn, each once no server used over 5% "
        "of a core for 0.5 s",
        f"- requests: streaming chat completions, greedy, no logit_bias: each answer ends where "
        f"the model ends it or at max_tokens, and tokens are counted from each server's "
        f"usage. Open-ended: {plan.max_tokens} tokens at most, {plan.single_requests} prompts "
        f"one at a time (questions and stories alternating; the first request after ready is "
        f"the first of them, counted with them and on its own), then {', '.join(map(str, plan.concurrency))} prompts at once; "
        f"input-grounded: a ~{plan.grounded_text_tokens}-token text returned with one word "
        f"changed, {plan.grounded_max_tokens} tokens at most, at "
        f"{', '.join(map(str, plan.grounded_concurrency))} stream(s); ~{plan.prefix_tokens}-token "
        f"shared system prompt ({plan.answer_tokens}-token answers); "
        f"{plan.admission_prompt_tokens}-token prompt admitted beside {plan.running_streams} "
        "running streams (an answer that ends is followed by the next prompt on its slot)",
        "- TTFT: request sent to first text chunk; ITL: gap between text chunks; end to end: "
        "completion tokens over the time from sending to the last token (1 stream: the median "
        "request; N streams: all tokens over the time from sending all to the last token); "
        "decode: the tokens after the first over the time from the first token to the last "
        "(N streams: from the earliest first token to the latest last one); the weight-"
        "streaming share: decode tokens/s over the bound's tokens/s",
        "- omlx-core, mlx_lm.server: each server's median over the rounds; ours / theirs: "
        "the median of the per-round ratios (each round measures both); range: their lowest "
        "and highest",
    ]


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
        plan = replace(plan, rounds=args.rounds)
    load_before = _load_average()
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
    no_speculation = replace(settings, overrides=(*settings.overrides, SPECULATION_OFF))
    # Prompts repeat from run to run and round to round: blocks an earlier server left
    # in an SSD cache would turn this one's cold prefills into hits.
    cache_roots: list[Path] = []

    def ours(server_settings: ServerSettings) -> Callable[[int], ServerSpec]:
        def make(port: int) -> ServerSpec:
            cache_roots.append(fresh_cache_root())
            return omlx_spec(None if served_id else model_dir, port, server_settings,
                             served_id, cache_roots[-1])
        return make

    contenders: list[Contender] = []
    if args.only in (None, OMLX):
        contenders.append(Contender(OMLX, ours(settings)))
        made = ours(no_speculation)
        contenders.append(Contender(OMLX_NO_SPECULATION,
                                    lambda port: _relabel(made(port), "speculation off"),
                                    every_phase=False))
    if args.only in (None, MLX_LM):
        contenders.append(Contender(MLX_LM, lambda port: mlx_lm_spec(model_dir, port, settings)))
    bound = measure_bound(model_dir, (1, 16), preload_env())
    from tqdm import tqdm

    runs: dict[str, ServerRun] = {}
    total = plan.rounds * sum(plan.requests if c.every_phase else
                              3 + plan.single_requests + sum(plan.concurrency)
                              for c in contenders)
    try:
        with tqdm(total=total, unit="req", file=sys.stderr) as progress:
            for index in range(plan.rounds):
                if index:  # the bound timed again before every round, the fastest kept
                    bound = bound.faster(measure_bound(model_dir, (1, 16), preload_env()))
                run_round(index, contenders, runs, model_dir, plan, progress)
    finally:
        for root in cache_roots:
            shutil.rmtree(root, ignore_errors=True)
    add_bound_shares(runs, bound)
    ordered = {name: runs[name] for name in (OMLX, OMLX_NO_SPECULATION, MLX_LM) if name in runs}
    report = render(ordered, _header(args, plan, model_dir, settings, bound, load_before))
    publish_report(report, args.out if args.out is not None else (None if args.quick else DEFAULT_OUT))
    return 0


def _relabel(spec: ServerSpec, what: str) -> ServerSpec:
    return replace(spec, name=OMLX_NO_SPECULATION, label=f"{spec.label}, {what}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omlx_core.bench.serving",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
