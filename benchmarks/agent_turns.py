"""An agent's conversation, turn by turn: TTFT of each turn of a growing context that
is resent whole every turn, ``omlx-core serve`` against ``mlx_lm.server``, per family.

    python -m benchmarks.agent_turns [--families default,gemma3,qwen3_next,gpt_oss]
        [--rounds 3] [--turns 8] [--parts ttft,reuse] [--shapes resend,compacted,fresh]
        [--out docs/agent-turns-bench.md]

Every turn the client sends the whole history through the chat endpoint (streaming,
greedy): a system prompt, then per turn a user message carrying tool output (prose of a
fixed token count, different every turn) and the answer the server gave the turn before,
as its text. On the default model (SmolLM2-135M) the context grows from a ~1k-token
system prompt to ~4k tokens by turn 8; the tiny random-weight families of
``omlx_core.testing`` (llama, qwen3, qwen3_moe, gemma3 with sliding windows, qwen3_next
with recurrent GatedDeltaNet layers, gpt_oss with sliding windows and sinks) grow from
1.2k to ~3.6k (their longest context is 4096).

Both servers are started afresh for each family and round, in an order that alternates
from round to round: omlx-core as the README starts it (``omlx-core serve``; the default
model by its served id, a tiny family with ``--model DIR``; a new ``OMLX_CACHE_DIR`` so
its SSD cache starts empty; any ``--set`` override printed), ``mlx_lm.server`` on the same
model directory with omlx-core's batch and prefill step. Before each turn the server is
let go quiet (under 5 % of a core for 0.5 s: what it writes to disk after a turn runs
while the agent is busy, not during the next turn). Where ``mlx_lm.server`` does not
start on a model directory, omlx-core's figures are reported alone, with its log's last
line as the reason.

Reported per family and turn: prompt tokens, each server's median TTFT over the rounds
with its range, the median of the per-round ratios (ours / theirs) and their range, and
the tokens each server's usage says it took from its cache. Targets (issue 35): turns
2-8 at or under 0.5x the peer's TTFT on the default model and 0.3x on the sliding-window
and hybrid families (gemma3, qwen3_next, gpt_oss).

``--parts reuse`` (no timing; omlx-core only): per family, each turn's cached tokens over
the tokens it shares with what the server saw the turn before (prompt, completion, stop
token; ``omlx_core.testing.conversation``), greedy, 8 turns, with one server for all
turns and with a server restarted before every turn (its memory empty: what it reuses
the SSD tier kept). The tiny families run on engines in this process (the "base" tier's
blocks, the SSD tier as ``serve`` starts it, :class:`~omlx_core.testing.served.ServedEngine`);
the default model on ``omlx-core serve`` as above, its answers' token ids read from
logprobs, a ~1k-token system prompt and 150 tokens of tool output a turn.

``--shapes`` (both parts) adds conversations whose turns part from the last one inside
it: the previous tool output cut to a stub before the next turn ("compacted"), or a new
task under the same system prompt each turn ("fresh"). The issue's targets are for the
history resent as it was ("resend", the default); the others are reported without one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, stream_chat
from omlx_core.bench.prompts import text_of_tokens
from omlx_core.bench.servers import (MLX_LM, OMLX, ServerProcess, ServerSettings, ServerSpec,
                                     free_port, fresh_cache_root, mlx_lm_spec, omlx_spec,
                                     wait_quiet)
from omlx_core.testing.conversation import SHAPES, Conversation, next_turn, with_tool_output

DEFAULT_OUT = Path("docs/agent-turns-bench.md")
DEFAULT_MODEL = "default"
FAMILIES = (DEFAULT_MODEL, "llama", "qwen3", "qwen3_moe", "gemma3", "qwen3_next", "gpt_oss")
#: the issue's targets: turns 2-8 TTFT, ours / mlx_lm.server's
TARGETS = {DEFAULT_MODEL: 0.5, "gemma3": 0.3, "qwen3_next": 0.3, "gpt_oss": 0.3}
#: ``FAMILY:small``: the family at the default model's width (``omlx_core.testing.SMALL``)
SMALL_SUFFIX = ":small"


def base_family(family: str) -> str:
    """``gemma3`` of ``gemma3:small``."""
    return family.removesuffix(SMALL_SUFFIX)


@dataclass(frozen=True)
class Context:
    """How a family's conversation grows: system prompt and tool output per turn (tokens)."""

    system_tokens: int
    tool_tokens: int
    answer_tokens: int


CONTEXTS = {DEFAULT_MODEL: Context(1000, 330, 32)}
TINY_CONTEXT = Context(1200, 250, 16)


@dataclass
class Run:
    """One server's turns in one round."""

    ttft: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int | None] = field(default_factory=list)


@dataclass
class FamilyResult:
    family: str
    model_dir: Path
    context: Context
    ours_command: str
    runs: dict[str, list[Run]] = field(default_factory=lambda: {OMLX: [], MLX_LM: []})
    peer_missing: str | None = None
    shape: str = "resend"

    @property
    def name(self) -> str:
        return shape_named(self.family, self.shape)


def shape_named(family: str, shape: str) -> str:
    """A family's name in the reports, with its conversation's shape unless "resend"."""
    return family if shape == "resend" else f"{family}, {shape}"


def converse(spec: ServerSpec, port: int, system: str, message: Callable[[int], str],
             turns: int, answer_tokens: int, shape: str = "resend") -> Run:
    """One conversation of ``turns`` turns on a freshly started server, each turn's
    messages following the last as ``shape`` says."""
    run = Run()
    messages = [{"role": "system", "content": system}]
    with ServerProcess(spec, port, ready_timeout=600) as server:
        for turn in range(turns):
            next_turn(messages, turn, message(turn), shape)
            wait_quiet([server.pid])
            record = stream_chat(server.host, port, chat_body(spec.model_id, messages, answer_tokens))
            run.ttft.append(record.ttft)
            run.prompt_tokens.append(record.prompt_tokens or 0)
            run.cached_tokens.append(record.cached_tokens)
            messages.append({"role": "assistant", "content": record.text})
    return run


def measure_family(family: str, model_dir: Path, served_id: str | None, settings: ServerSettings,
                   rounds: int, turns: int, cache_roots: list[Path],
                   shape: str = "resend") -> FamilyResult:
    context = CONTEXTS.get(family, TINY_CONTEXT)
    system = text_of_tokens(model_dir, context.system_tokens, seed=35,
                            heading="You are an agent. Follow these rules.")
    message = with_tool_output(model_dir, context.tool_tokens)

    def ours(port: int) -> ServerSpec:
        cache_roots.append(fresh_cache_root())
        return omlx_spec(None if served_id else model_dir, port, settings, served_id,
                         cache_roots[-1])

    def theirs(port: int) -> ServerSpec:
        return mlx_lm_spec(model_dir, port, settings)

    result = FamilyResult(family, model_dir, context, ours(0).command().replace(" --port 0", ""),
                          shape=shape)
    makers = {OMLX: ours, MLX_LM: theirs}
    for index in range(rounds):
        order = (OMLX, MLX_LM) if index % 2 == 0 else (MLX_LM, OMLX)
        for name in order:
            if name == MLX_LM and result.peer_missing:
                continue
            port = free_port()
            try:
                run = converse(makers[name](port), port, system, message, turns,
                               context.answer_tokens, shape)
            except RuntimeError as error:
                if name != MLX_LM:
                    raise
                lines = [line for line in str(error).splitlines() if line.strip()]
                result.peer_missing = lines[-1] if lines else str(error)
                print(f"  {family}: mlx_lm.server does not serve it: {result.peer_missing}",
                      flush=True)
                continue
            result.runs[name].append(run)
            print(f"  {result.name} round {index + 1} {name}: TTFT "
                  + " ".join(f"{t:.3f}" for t in run.ttft), flush=True)
    return result


def _spread(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "-"
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def ratios(result: FamilyResult, turn: int) -> list[float]:
    """Ours / theirs for ``turn``, one per round both servers measured."""
    return [ours.ttft[turn] / theirs.ttft[turn]
            for ours, theirs in zip(result.runs[OMLX], result.runs[MLX_LM])]


def later_turn_ratios(result: FamilyResult) -> list[float]:
    """Per round, ours / theirs of the summed TTFT of turns 2 onwards."""
    return [sum(ours.ttft[1:]) / sum(theirs.ttft[1:])
            for ours, theirs in zip(result.runs[OMLX], result.runs[MLX_LM])]


def _cached(runs: Sequence[Run], turn: int) -> str:
    """The median of the cached tokens a server's usage reported for ``turn``."""
    cached = [r.cached_tokens[turn] for r in runs if r.cached_tokens[turn] is not None]
    return str(int(statistics.median(cached))) if cached else "-"


def render_family(result: FamilyResult) -> list[str]:
    context = result.context
    name = f"`{result.model_dir.name}`" if result.family != DEFAULT_MODEL else \
        f"the default model (`{result.model_dir.name}`)"
    lines = [f"### {result.name}", "",
             f"Model {name}; system prompt {context.system_tokens} tokens, tool output "
             f"{context.tool_tokens} tokens a turn, answers up to {context.answer_tokens} "
             f"tokens; omlx-core: `{result.ours_command}`.", ""]
    if result.peer_missing:
        lines += [f"mlx_lm.server did not start on this directory: `{result.peer_missing}`; "
                  "omlx-core alone.", ""]
    lines += ["| turn | prompt tokens | omlx-core TTFT (s) | mlx_lm.server TTFT (s) | "
              "ours / theirs | cached tokens, omlx-core | cached tokens, mlx_lm.server |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    ours, theirs = result.runs[OMLX], result.runs[MLX_LM]
    for turn in range(len(ours[0].ttft)):
        lines.append(f"| {turn + 1} | {ours[0].prompt_tokens[turn]} | "
                     f"{_spread([r.ttft[turn] for r in ours])} | "
                     f"{_spread([r.ttft[turn] for r in theirs])} | "
                     f"{_spread(ratios(result, turn), 2)} | "
                     f"{_cached(ours, turn)} | {_cached(theirs, turn)} |")
    later = later_turn_ratios(result)
    if later:
        target = TARGETS.get(base_family(result.family)) if result.shape == "resend" else None
        verdict = ""
        if target is not None:
            met = statistics.median(later) <= target
            verdict = f"; target <= {target:g}x {'met' if met else 'MISSED'}"
        worst = max(statistics.median(ratios(result, t)) for t in range(1, len(ours[0].ttft)))
        lines += ["", f"Turns 2-{len(ours[0].ttft)}, summed TTFT, ours / theirs: "
                      f"**{_spread(later, 2)}** (median of rounds, range); the worst turn's "
                      f"median ratio {worst:.2f}{verdict}."]
    return lines + [""]


def render(results: list[FamilyResult], header: list[str]) -> str:
    lines = ["# Agent turns: TTFT of each turn of a resent, growing conversation", "", *header, "",
             "## Summary: turns 2 onwards, summed TTFT, ours / mlx_lm.server", "",
             "| family | rounds | ours / theirs (median, range) | target |", "|---|---:|---:|---:|"]
    for result in results:
        later = later_turn_ratios(result)
        target = TARGETS.get(base_family(result.family)) if result.shape == "resend" else None
        verdict = "" if target is None or not later else \
            f"<= {target:g}x {'met' if statistics.median(later) <= target else 'MISSED'}"
        shown = _spread(later, 2) if later else f"peer did not start ({len(result.runs[OMLX])} rounds ours)"
        lines.append(f"| {result.name} | {len(result.runs[OMLX])} | {shown} | {verdict} |")
    lines += ["", "## Per turn", ""]
    for result in results:
        lines += render_family(result)
    return "\n".join(lines)


# -- reuse: cached over shared tokens per turn -------------------------------------------

REUSE_SYSTEM_TOKENS = 1000
REUSE_TOOL_TOKENS = 150


def reuse_rows(family: str, model_dir: Path, served_id: str | None, turns: int,
               settings: ServerSettings, cache_roots: list[Path],
               shape: str = "resend") -> list[tuple[str, Conversation]]:
    """The family's conversation (``shape``: how each turn follows the last,
    :data:`~omlx_core.testing.conversation.SHAPES`) with one server, and with a server
    restarted every turn."""
    named = shape_named(family, shape)
    from mlx_lm.utils import load_tokenizer

    from omlx_core.testing.conversation import converse, engine_asker, http_asker

    tokenizer = load_tokenizer(model_dir)
    if served_id is None:
        def asker(ssd: Path, restart: bool):
            held: list = []

            def ask(messages, prompt):
                from omlx_core.testing.served import ServedEngine

                if restart or not held:
                    if held:
                        held.pop().stop()
                    held.append(ServedEngine(model_dir, ssd))
                return engine_asker(held[-1].engine, tokenizer, max_tokens=16)(messages, prompt)

            return ask, lambda: [engine.stop() for engine in held]

        rows = []
        for restart in (False, True):
            cache_roots.append(Path(tempfile.mkdtemp(prefix="omlx-agent-ssd-")))
            ask, close = asker(cache_roots[-1], restart)
            try:
                rows.append((f"{named}{', restarts' if restart else ''}",
                             converse(ask, tokenizer, turns=turns, shape=shape)))
            finally:
                close()
        return rows

    import openai

    system = text_of_tokens(model_dir, REUSE_SYSTEM_TOKENS, seed=35, heading="Follow these rules.")
    message = with_tool_output(model_dir, REUSE_TOOL_TOKENS)
    rows = []
    for restart in (False, True):
        cache_roots.append(fresh_cache_root())
        root = cache_roots[-1]
        held: list = []

        def ask(messages, prompt, root=root, restart=restart, held=held):
            if restart or not held:
                if held:
                    held.pop().stop()
                port = free_port()
                server = ServerProcess(omlx_spec(None, port, settings, served_id, root), port,
                                       ready_timeout=600)
                held.append(server.__enter__())
            server = held[-1]
            client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1",
                                   api_key="unused", max_retries=0, timeout=600)
            return http_asker(client, served_id, model_dir, 24)(messages, prompt)

        try:
            rows.append((f"{named}{', restarts' if restart else ''}",
                         converse(ask, tokenizer, turns=turns, system_prompt=system,
                                  message=message, shape=shape)))
        finally:
            for server in held:
                server.stop()
    return rows


def render_reuse(rows: list[tuple[str, Conversation]]) -> list[str]:
    turns = max(len(c.turns) for _, c in rows)
    lines = ["## Reuse: cached / shared tokens per turn", "",
             "| conversation | " + " | ".join(f"turn {i + 2}" for i in range(turns)) + " | worst |",
             "|---|" + "---:|" * (turns + 1)]
    for name, conversation in rows:
        cells = [f"{t.cached_tokens}/{t.shared_tokens}" for t in conversation.turns]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {conversation.worst_reuse:.1%} |")
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_turns", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated, of {', '.join(FAMILIES)} (default: all); "
                             f"FAMILY{SMALL_SUFFIX} is a random-weight family at the default "
                             "model's width (llama, gemma3, qwen3_next, gpt_oss)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--parts", default="ttft",
                        help="comma-separated: ttft (the timed comparison), reuse (cached over "
                             "shared tokens per turn, with and without restarts)")
    parser.add_argument("--shapes", default="resend",
                        help="comma-separated: resend (the history as it "
                             "was), compacted (the previous user message cut to a stub), fresh "
                             "(a new task under the same system prompt each turn)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for omlx-core (printed in the report)")
    parser.add_argument("--out", type=Path, help=f"write the markdown report here (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    from omlx_core.testing import SMALL

    known = {*FAMILIES, *(f + SMALL_SUFFIX for f in SMALL)}
    unknown = sorted(set(families) - known)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if (unknown or args.rounds < 1 or args.turns < 2 or not parts or parts - {"ttft", "reuse"}
            or not shapes or set(shapes) - set(SHAPES)):
        raise SystemExit(f"--families takes {', '.join(sorted(known))} (not {unknown}); --rounds >= 1; "
                         f"--turns >= 2; --parts takes ttft, reuse; --shapes takes {', '.join(SHAPES)}")

    import shutil

    from omlx_core.bench.serving import settings_for
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model
    from omlx_core.testing import cached_model

    settings = settings_for(None, args.set)
    load = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="omlx-agent-turns-"))
    cache_roots: list[Path] = []
    results = []
    reuse: list[tuple[str, Conversation]] = []
    try:
        for family in families:
            if family == DEFAULT_MODEL:
                model_dir, served_id = ensure_default_model(), load_config(None)["server.models"][0]
            else:
                size = "small" if family.endswith(SMALL_SUFFIX) else "tiny"
                model_dir = cached_model(base_family(family), 0, cache_dir=workdir, size=size)
                served_id = None
            model_dir = Path(model_dir).resolve()
            if "reuse" in parts:
                for shape in shapes:
                    print(f"{family}: reuse over {args.turns} turns ({shape})", flush=True)
                    reuse += reuse_rows(family, model_dir, served_id, args.turns, settings,
                                        cache_roots, shape)
            if "ttft" in parts:
                for shape in shapes:
                    print(f"{family}: {args.rounds} rounds of {args.turns} turns ({shape})", flush=True)
                    results.append(measure_family(family, model_dir, served_id, settings,
                                                  args.rounds, args.turns, cache_roots, shape))
    finally:
        for root in cache_roots:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    overrides = ", ".join(f"`{o}`" for o in settings.overrides) or "none"
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average before {load[0]:.2f}; {args.rounds} rounds of "
        f"{args.turns} turns per family and server",
        f"- omlx-core started as `./setup.sh serve` starts it: tier `{settings.tier}` (picked for "
        f"this machine), overrides: {overrides}; a new `OMLX_CACHE_DIR` per server start (the "
        "SSD cache starts empty). mlx_lm.server on the same model directory with omlx-core's "
        f"max batch ({settings.max_batch_size}) and prefill step ({settings.prefill_step_size})",
        "- each round starts both servers afresh, in an order that alternates from round to "
        "round; before each turn the server is let go quiet (under 5 % of a core for 0.5 s)",
        "- TTFT: streaming chat request (greedy, the whole history) sent to its first text "
        "chunk; cells: median over the rounds (lowest-highest); ours / theirs: the median of "
        "the per-round ratios (range)",
    ]
    if not results:
        header = [header[0].split(";")[0] + f"; {args.turns} turns per conversation, no timing"]
    report = render(results, header) if results else "# Agent turns\n\n" + "\n".join(header)
    if reuse:
        report += "\n\n" + "\n".join(render_reuse(reuse))
    publish_report(report, args.out if args.out is not None else DEFAULT_OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
