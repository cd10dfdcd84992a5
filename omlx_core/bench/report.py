"""The serving benchmark's figures (:data:`METRICS`) and its markdown report.

Every figure is measured once per round on each server. The table gives each server's
median over the rounds and, for ours against ``mlx_lm.server``, the median of the
per-round ratios (a round measures both servers back to back) with their range.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

from omlx_core.bench.phases import Observations
from omlx_core.bench.servers import MLX_LM, OMLX, ServerSpec

#: omlx-core with ``plugin.batched.speculation=false`` (the open-ended phases only)
OMLX_NO_SPECULATION = "omlx-no-speculation"


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    #: ours/theirs must be >= this (higher is better) or <= this (lower is better)
    target: float | None = None
    digits: int = 2
    #: ours alone must be <= this (lower is better) or >= this (higher is better)
    limit: float | None = None
    #: which of our servers the figure is ours from
    ours: str = OMLX
    unit: str = "s"


def _open_ended(ours: str, suffix: str, targets: dict[str, float]) -> list[Metric]:
    rows = []
    for streams in (1, 8, 16):
        where = "1 stream" if streams == 1 else f"{streams} streams"
        rows.append(Metric(f"tps_{streams}", f"open-ended, {where}: tokens/s end to end{suffix}",
                           True, target=targets.get(f"tps_{streams}"), digits=1, ours=ours))
        rows.append(Metric(f"decode_{streams}", f"open-ended, {where}: decode tokens/s (first "
                           f"to last token){suffix}", True, digits=1, ours=ours))
        if streams == 1:
            for kind in ("question", "story"):
                rows.append(Metric(f"decode_1_{kind}", f"open-ended, 1 stream, {kind} prompts: "
                                   f"decode tokens/s{suffix}", True, digits=1, ours=ours))
    for streams in (1, 16):
        rows.append(Metric(f"bound_{streams}", f"decode tokens/s at {streams} stream(s) over "
                           f"the weight-streaming bound{suffix}", True,
                           limit=0.75 if ours == OMLX else None, ours=ours, unit=""))
    return rows


METRICS: tuple[Metric, ...] = (
    Metric("first_ttft", "first request after ready: TTFT (s)", False, digits=3),
    Metric("first_seconds", "first request after ready: end to end (s)", False),
    *_open_ended(OMLX, "", {"tps_1": 1.1, "tps_8": 1.2, "tps_16": 1.35}),
    *_open_ended(OMLX_NO_SPECULATION, ", our speculation off", {}),
    Metric("grounded_tps_1", "input-grounded (edit a given text), 1 stream: tokens/s end to end",
           True, target=1.8, digits=1),
    Metric("grounded_decode_1", "input-grounded, 1 stream: decode tokens/s", True, digits=1),
    Metric("grounded_tps_8", "input-grounded, 8 streams: tokens/s end to end", True, target=1.4,
           digits=1),
    Metric("grounded_decode_8", "input-grounded, 8 streams: decode tokens/s", True, digits=1),
    Metric("ttft_1_p50", "TTFT p50, 1 stream (s)", False, digits=3),
    Metric("ttft_1_p95", "TTFT p95, 1 stream (s)", False, digits=3),
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
class ServerRun:
    """One server configuration over every round."""

    spec: ServerSpec
    #: figures by metric key, one dict per round
    rounds: list[dict[str, float]] = field(default_factory=list)
    #: notes by topic, one dict per round
    notes: list[dict[str, str]] = field(default_factory=list)
    #: notes that hold for every round
    facts: list[str] = field(default_factory=list)
    observations: Observations = field(default_factory=Observations)

    def values(self, key: str) -> list[float | None]:
        return [figures.get(key) for figures in self.rounds]


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(kept) if kept else None


def _format(value: float | None, digits: int) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def compare(metric: Metric, ours: ServerRun | None, theirs: ServerRun | None
            ) -> tuple[float | None, float | None, list[float]]:
    """Our median, their median, and the per-round ratios where both were measured."""
    mine = ours.values(metric.key) if ours else []
    other = theirs.values(metric.key) if theirs else []
    ratios = [a / b for a, b in zip(mine, other)
              if a is not None and b and not math.isnan(a) and not math.isnan(b)]
    return _median(mine), _median(other), ratios


def _target(metric: Metric, mine: float | None, ratio: float | None) -> str:
    higher = metric.higher_is_better
    if metric.limit is not None:
        text = f"{'>=' if higher else '<='} {metric.limit:g}{' ' + metric.unit if metric.unit else ''}"
        if mine is not None and not math.isnan(mine):
            met = mine >= metric.limit if higher else mine <= metric.limit
            text += " met" if met else " MISSED"
        return text
    if metric.target is None:
        return ""
    text = f"{'>=' if higher else '<='} {metric.target:g}x"
    if ratio is not None:
        met = ratio >= metric.target if higher else ratio <= metric.target
        text += " met" if met else " MISSED"
    return text


def table(runs: dict[str, ServerRun]) -> list[str]:
    theirs = runs.get(MLX_LM)
    lines = ["| metric | better | omlx-core | mlx_lm.server | ours / theirs | range over rounds "
             "| target |", "|---|---|---:|---:|---:|---|---|"]
    for metric in METRICS:
        ours = runs.get(metric.ours)
        if ours is None and theirs is None:
            continue
        mine, other, ratios = compare(metric, ours, theirs)
        ratio = statistics.median(ratios) if ratios else None
        spread = (f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-")
        lines.append(f"| {metric.label} | {'higher' if metric.higher_is_better else 'lower'} | "
                     f"{_format(mine, metric.digits)} | {_format(other, metric.digits)} | "
                     f"{_format(ratio, 2)} | {spread} | {_target(metric, mine, ratio)} |")
    return lines


def identical_answers(ours: ServerRun, theirs: ServerRun) -> str:
    """How many of our answers are the peer's, word for word (greedy decoding of one
    model: they differ only where the two servers' arithmetic does), by phase."""
    by_phase: dict[str, list[bool]] = {}
    for key, text in ours.observations.answers.items():
        other = theirs.observations.answers.get(key)
        if other is not None:
            by_phase.setdefault(key[1], []).append(text == other)
    return ", ".join(f"{phase} {sum(same)}/{len(same)}" for phase, same in by_phase.items())


def speculation_lines(runs: dict[str, ServerRun]) -> list[str]:
    lines = []
    for run in runs.values():
        parts = []
        for phase, drafts in run.observations.drafts.items():
            if drafts.unreported == drafts.requests:
                parts.append(f"{phase}: {drafts.completion} tokens, none drafted")
            else:
                parts.append(f"{phase}: {drafts.completion} tokens, {drafts.drafted} drafted, "
                             f"{drafts.accepted} accepted")
        if parts:
            lines.append(f"- {run.spec.label}: " + "; ".join(parts))
    return lines


def render(runs: dict[str, ServerRun], header: Sequence[str]) -> str:
    """The markdown report: header, the table, what the usage said of drafts, how alike
    the answers were, each server's command and notes."""
    lines = ["## Serving benchmark: omlx-core vs mlx_lm.server", "", *header, "", *table(runs)]
    speculation = speculation_lines(runs)
    if speculation:
        lines += ["", "Drafted and accepted tokens, from each server's usage (every round; "
                  "mlx_lm.server drafts only with a draft model, none is given):", "",
                  *speculation]
    theirs = runs.get(MLX_LM)
    alike = [f"- {run.spec.label}: {identical_answers(run, theirs)}"
             for name, run in runs.items() if name != MLX_LM and theirs is not None]
    if alike:
        lines += ["", "Answers word for word the same as mlx_lm.server's (same round, same "
                  "prompt):", "", *alike]
    for run in runs.values():
        repetition = run.observations.repetition
        if repetition:
            lines += ["", f"Repeated word 4-grams in {run.spec.label}'s 1-stream answers (mean "
                      "share): " + ", ".join(f"{kind} prompts {statistics.mean(shares):.2f}"
                                              for kind, shares in repetition.items())]
            break
    for run in runs.values():
        lines += ["", f"**{run.spec.label}** (`{run.spec.command()}`)", ""]
        lines += [f"- {fact}" for fact in run.facts]
        topics = list(dict.fromkeys(topic for notes in run.notes for topic in notes))
        for topic in topics:
            texts = [notes.get(topic, "-") for notes in run.notes]
            if len(set(texts)) == 1:
                lines.append(f"- {texts[0]}")
            else:
                lines.append("- " + " | ".join(f"round {i + 1}: {text}"
                                               for i, text in enumerate(texts)))
        lines += [f"- lacks {item}" for item in run.spec.lacks]
    return "\n".join(lines) + "\n"
