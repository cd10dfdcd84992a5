"""Served decode throughput, before and after the fused sampling step, against mlx_lm.server.

    python -m benchmarks.decode_serving [--rounds 2] [--max-tokens 128] [--out FILE]

Three servers, one at a time, in rounds whose order rotates so that none always runs
first (the machine's load drifts):

- ``omlx-core serve`` as a user starts it (fused sampling on, the default);
- ``omlx-core serve --set plugin.batched.fused_sampling=false`` (mlx-lm's decode step,
  the code before the change);
- ``mlx_lm.server`` with omlx-core's batch and prefill settings.

Each is started, warmed up, measured at 1, 8 and 16 streams with ``omlx-core bench``'s
requests (greedy streaming chat, special tokens banned by ``logit_bias`` so every
stream runs to ``--max-tokens``), and stopped. Figures are the medians over rounds of aggregate tokens/s and of the server
process's CPU time per completion token (all its threads; on a shared machine CPU time
moves less with the load than wall time does); ratios are the medians of the per-round
ratios.
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
from typing import Callable, Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import special_token_ids
from omlx_core.bench.servers import ServerProcess, ServerSpec, free_port, mlx_lm_spec, omlx_spec
from omlx_core.bench.serving import FULL, Bench, settings_for

DEFAULT_OUT = Path("docs/bench-decode-serving.md")
FUSED, UNFUSED, PEER = "omlx-core (fused sampling)", "omlx-core (mlx-lm's step)", "mlx_lm.server"
STEP_OFF = "plugin.batched.fused_sampling=false"
STREAMS = (1, 8, 16)


def _load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_once(spec: ServerSpec, port: int, model_dir: Path, max_tokens: int,
                 banned: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Per stream count of :data:`STREAMS`: aggregate tokens/s of one started server, and
    the server's CPU milliseconds per completion token (less sensitive than wall time to
    what else the machine runs)."""
    from tqdm import tqdm

    plan = replace(FULL, max_tokens=max_tokens, single_requests=2, rounds=1)
    figures: dict[int, tuple[float, float]] = {}
    with ServerProcess(spec, port) as server, tqdm(total=5 + sum(STREAMS), unit="req",
                                                   desc=spec.label, file=sys.stderr) as progress:
        bench = Bench(server, model_dir, plan, banned, progress)
        bench.warm_up()
        for streams in STREAMS:
            cpu_before = cpu_seconds(server.pid)
            batch, seconds = bench.concurrent(
                [bench.story(f"ab{streams}", i) for i in range(streams)], max_tokens)
            tokens = sum(r.completion_tokens for r in batch)
            figures[streams] = (tokens / seconds,
                                1000 * (cpu_seconds(server.pid) - cpu_before) / tokens)
    return figures


def run(args: argparse.Namespace) -> int:
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model

    model_dir = Path(ensure_default_model()).resolve()
    served_id = load_config(None)["server.models"][0]
    defaults = settings_for(None, [])
    unfused = settings_for(None, [STEP_OFF])
    banned = special_token_ids(model_dir)
    makers: dict[str, Callable[[int], ServerSpec]] = {
        FUSED: lambda port: omlx_spec(None, port, defaults, served_id),
        UNFUSED: lambda port: omlx_spec(None, port, unfused, served_id),
        PEER: lambda port: mlx_lm_spec(model_dir, port, defaults),
    }
    names = list(makers)
    per_round: list[dict[str, dict[int, tuple[float, float]]]] = []
    loads = [_load_average()]
    for round_index in range(args.rounds):
        order = names[round_index % 3:] + names[:round_index % 3]
        figures = {}
        for name in order:
            port = free_port()
            figures[name] = measure_once(makers[name](port), port, model_dir, args.max_tokens,
                                         banned)
            loads.append(_load_average())
        per_round.append(figures)
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; {args.rounds} rounds, server order rotated each round",
        f"- load average (1, 5, 15 min) before and after each server: {'; '.join(loads)}",
        f"- model `{model_dir.name}`; tier `{defaults.tier}` (picked for this machine); "
        f"max batch {defaults.max_batch_size}, prefill step {defaults.prefill_step_size} "
        f"for every server; {defaults.http_threads} HTTP threads",
        f"- {UNFUSED}: the only override, `--set {STEP_OFF}`",
        f"- greedy streaming chat, special tokens banned by logit_bias, {args.max_tokens} tokens "
        "per stream; tokens/s: completion tokens over wall time, first request to last token",
    ]
    publish_report(render(per_round, header), args.out)
    return 0


def render(per_round: Sequence[dict[str, dict[int, tuple[float, float]]]],
           header: Sequence[str]) -> str:
    def median(name: str, streams: int, which: int) -> float:
        return statistics.median(r[name][streams][which] for r in per_round)

    def ratio(a: str, b: str, streams: int, which: int) -> float:
        return statistics.median(r[a][streams][which] / r[b][streams][which] for r in per_round)

    lines = ["## Served decode throughput: fused sampling step vs mlx-lm's step vs mlx_lm.server",
             "", *header, ""]
    for which, title, unit in ((0, "aggregate tokens/s (higher is better)", "tok/s"),
                               (1, "server CPU ms per completion token (lower is better)", "ms")):
        lines += [f"### {title}", "",
                  f"| streams | {FUSED} | {UNFUSED} | {PEER} | fused / mlx-lm's step | "
                  f"fused / {PEER} | mlx-lm's step / {PEER} |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for streams in STREAMS:
            lines.append(
                f"| {streams} | {median(FUSED, streams, which):.1f} {unit} | "
                f"{median(UNFUSED, streams, which):.1f} {unit} | {median(PEER, streams, which):.1f} {unit} | "
                f"{ratio(FUSED, UNFUSED, streams, which):.3f}x | {ratio(FUSED, PEER, streams, which):.3f}x | "
                f"{ratio(UNFUSED, PEER, streams, which):.3f}x |")
        lines.append("")
    lines += ["Per round (tokens/s at 1 / 8 / 16 streams; CPU ms per token in brackets):", ""]
    for index, figures in enumerate(per_round):
        lines.append(f"- round {index + 1}: " + "; ".join(
            f"{name} " + " / ".join(f"{figures[name][s][0]:.1f} ({figures[name][s][1]:.0f})"
                                    for s in STREAMS) for name in figures))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_serving",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
