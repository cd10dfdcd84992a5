"""Served A/B of two checkouts of omlx-core: throughput and TTFT at 1, 8 and 16 streams.

    python -m benchmarks.checkout_ab --before PATH [--rounds 3] [--max-tokens 128] [--out FILE]

``--before`` is another checkout of this repository with its own virtualenv
(``PATH/.venv``, made by ``./setup.sh``): for a structural change, the commit before it
(``git worktree add ../before <commit>``, then ``./setup.sh test --co -q`` there). Both
servers are started as the README starts them (``omlx-core serve``, no flags beyond the
address: the tier the machine picks, default model), one at a time, in rounds whose
order alternates, each with a fresh ``OMLX_CACHE_DIR`` (so no prefix is cached on disk
from an earlier run). Each is warmed up and then given ``omlx-core bench``'s requests:
greedy streaming chat with the special tokens banned by ``logit_bias``, so every stream
runs to ``--max-tokens``. Reported: medians over rounds of aggregate tokens/s and TTFT
p50 per stream count, and the median of the per-round after/before ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import special_token_ids
from omlx_core.bench.servers import ServerProcess, ServerSpec, free_port, fresh_cache_root, omlx_spec
from omlx_core.bench.serving import FULL, Bench, settings_for

STREAMS = (1, 8, 16)
BEFORE, AFTER = "before", "after"
DEFAULT_OUT = Path("docs/bench-checkout-ab.md")


def _python_of(checkout: Path) -> str:
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{checkout} has no .venv/bin/python: run ./setup.sh test --co -q there first")
    return str(python)


def _commit_of(checkout: Path) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip() or "?"


def measure_once(spec: ServerSpec, port: int, model_dir: Path, max_tokens: int,
                 banned: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Per stream count: aggregate tokens/s and TTFT p50 (s) of one started server."""
    from tqdm import tqdm

    plan = replace(FULL, max_tokens=max_tokens, single_requests=2, rounds=1)
    figures: dict[int, tuple[float, float]] = {}
    with ServerProcess(spec, port) as server, tqdm(total=5 + sum(STREAMS), unit="req",
                                                   desc=spec.label, file=sys.stderr) as progress:
        bench = Bench(server, model_dir, plan, banned, progress)
        bench.warm_up()
        for streams in STREAMS:
            records, seconds = bench.concurrent(
                [bench.story(f"ab{streams}", i) for i in range(streams)], max_tokens)
            tokens = sum(r.completion_tokens for r in records)
            figures[streams] = (tokens / seconds, statistics.median(r.ttft for r in records))
    return figures


def run(args: argparse.Namespace) -> int:
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model

    before = args.before.resolve()
    pythons = {BEFORE: _python_of(before), AFTER: sys.executable}
    model_dir = Path(ensure_default_model()).resolve()
    served_id = load_config(None)["server.models"][0]
    defaults = settings_for(None, [])
    banned = special_token_ids(model_dir)

    def spec(name: str, port: int) -> ServerSpec:
        made = omlx_spec(None, port, defaults, served_id, cache_root=fresh_cache_root())
        # Python puts the working directory first on sys.path, which would give the
        # "before" interpreter this checkout's omlx_core: each must import its own.
        return replace(made, label=f"omlx-core serve ({name})",
                       argv=[pythons[name], *made.argv[1:]],
                       env=(*made.env, ("PYTHONSAFEPATH", "1")))

    per_round: list[dict[str, dict[int, tuple[float, float]]]] = []
    loads = [os.getloadavg()[0]]
    for index in range(args.rounds):
        order = (BEFORE, AFTER) if index % 2 == 0 else (AFTER, BEFORE)
        figures = {}
        for name in order:
            port = free_port()
            figures[name] = measure_once(spec(name, port), port, model_dir, args.max_tokens, banned)
            loads.append(os.getloadavg()[0])
        per_round.append(figures)
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; {args.rounds} rounds, order alternated each round",
        f"- before: commit {_commit_of(before)}; after: commit {_commit_of(Path.cwd())}",
        f"- 1-minute load average before and after each server: "
        f"{', '.join(f'{x:.1f}' for x in loads)}",
        f"- both as `omlx-core serve` starts (tier `{defaults.tier}`, picked for this machine; "
        f"max batch {defaults.max_batch_size}, prefill step {defaults.prefill_step_size}); "
        "no overrides; a fresh OMLX_CACHE_DIR per server",
        f"- greedy streaming chat, special tokens banned by logit_bias, {args.max_tokens} tokens "
        "per stream; tokens/s: completion tokens over wall time, first request to last token",
    ]
    publish_report(render(per_round, header), args.out)
    return 0


def render(per_round: Sequence[dict[str, dict[int, tuple[float, float]]]],
           header: Sequence[str]) -> str:
    def median(name: str, streams: int, which: int) -> float:
        return statistics.median(r[name][streams][which] for r in per_round)

    def ratio(streams: int, which: int) -> float:
        return statistics.median(r[AFTER][streams][which] / r[BEFORE][streams][which]
                                 for r in per_round)

    lines = ["## Served A/B of two checkouts (throughput and TTFT)", "", *header, "",
             "| streams | tok/s before | tok/s after | after / before (higher is better) "
             "| TTFT p50 before | TTFT p50 after | after / before (lower is better) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for streams in STREAMS:
        lines.append(
            f"| {streams} | {median(BEFORE, streams, 0):.1f} | {median(AFTER, streams, 0):.1f} | "
            f"{ratio(streams, 0):.3f}x | {median(BEFORE, streams, 1):.3f} s | "
            f"{median(AFTER, streams, 1):.3f} s | {ratio(streams, 1):.3f}x |")
    lines += ["", "Per round (tok/s at 1 / 8 / 16 streams; TTFT p50 in brackets):", ""]
    for index, figures in enumerate(per_round):
        lines.append(f"- round {index + 1}: " + "; ".join(
            f"{name} " + " / ".join(f"{figures[name][s][0]:.1f} ({figures[name][s][1]:.2f} s)"
                                    for s in STREAMS) for name in figures))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkout_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True,
                        help="another checkout of omlx-core with its own .venv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
