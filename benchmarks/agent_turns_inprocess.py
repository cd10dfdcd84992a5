"""Where a tiny family's per-turn gap comes from: the agent conversation of
``benchmarks.agent_turns`` held in this process, omlx-core's batched engine against
mlx-lm's own generate, no HTTP on either side.

    python -m benchmarks.agent_turns_inprocess [--families qwen3_next,gpt_oss] [--rounds 3]

omlx-core: the engine as ``serve`` builds it (:class:`~omlx_core.testing.served.ServedEngine`,
the tier ``serve`` picks for this machine, its prefix cache), once without an SSD tier and
once with one in a new directory as ``serve`` starts it; each turn a greedy request by
token ids, TTFT to its first token. mlx-lm: what ``mlx_lm.server`` does with a cache it
cannot trim (recurrent or rotating layers): it keeps the cache of the previous prompt
less its last token, resumes a copy of it when the next prompt starts with those tokens,
prefills the rest in steps of omlx-core's prefill step and generates
(``mlx_lm.generate.stream_generate``), TTFT to its first token. The three start afresh
each round, in an order that reverses from round to round; the same system prompt, tool
output and answer lengths as ``benchmarks.agent_turns``. Also reported: the engine's
prefill forwards per turn (the block boundaries it keeps snapshots at split a turn's new
tokens).

Where ``benchmarks.agent_turns`` shows a served gap, the engine's ratios here are its
part of it, with and without the SSD tier; the rest is the served path (template and
tokenizing over the whole history, the pipeline, SSE).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.agent_turns import TINY_CONTEXT
from omlx_core.bench import publish_report
from omlx_core.bench.prompts import text_of_tokens
from omlx_core.testing.conversation import Reply, converse, with_tool_output

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma3", "qwen3_next", "gpt_oss")
DEFAULT_OUT = Path("docs/agent-turns-inprocess-bench.md")
TIMEOUT_S = 300.0
SIDES = ("engine", "engine + SSD tier", "mlx-lm")


@dataclass(frozen=True)
class Round:
    """One round's TTFT per turn of each side, and the engine's prefill forwards per turn."""

    engine: list[float]
    tiered: list[float]
    forwards: list[int]
    peer: list[float]


def ours(model_dir: Path, turns: int, system: str, message, tokenizer: Any,
         tier: str, ssd: bool) -> tuple[list[float], list[int]]:
    """TTFT per turn and prefill forwards per turn of omlx-core's engine, with its SSD
    tier in a new directory (``ssd``, removed after, whatever happens) or none."""
    from omlx_core.testing.served import ServedEngine

    ttft: list[float] = []
    forwards: list[int] = []
    ssd_dir = tempfile.mkdtemp(prefix="omlx-agent-ssd-") if ssd else ""
    try:
        with ServedEngine(model_dir, ssd_dir, tier=tier) as served:
            converse(_timed_asker(served.engine, tokenizer, ttft, forwards), tokenizer,
                     turns=turns, system_prompt=system, message=message)
    finally:
        if ssd_dir:
            shutil.rmtree(ssd_dir, ignore_errors=True)
    return ttft, forwards


def _timed_asker(engine: Any, tokenizer: Any, ttft: list[float], forwards: list[int]):
    """Greedy turns on ``engine``, as :func:`~omlx_core.testing.conversation.engine_asker`
    submits them (with the cache points the serving pipeline gives), each turn's TTFT
    and prefill forwards appended."""
    from omlx_core.engine import GenerationRequest, SamplingParams

    ids = itertools.count()

    def ask(messages: list[dict[str, str]], prompt: list[int]) -> Reply:
        request = GenerationRequest(f"turn-{next(ids)}", prompt, SamplingParams(
            temperature=0.0, max_tokens=TINY_CONTEXT.answer_tokens),
            cache_points=engine.cache_points(messages, prompt))
        before = engine.stats()["prefill_forwards"]
        started = time.perf_counter()
        handle = engine.submit(request)
        tokens: list[int] = []
        while True:
            output = handle.next_output(timeout=TIMEOUT_S)
            if output is None:
                raise RuntimeError(f"the engine sent nothing for {TIMEOUT_S:.0f} s")
            if not tokens and output.token_ids:
                ttft.append(time.perf_counter() - started)
            tokens += output.token_ids
            if output.finished:
                break
        if output.error:
            raise RuntimeError(f"the turn failed: {output.error}")
        forwards.append(engine.stats()["prefill_forwards"] - before)
        return Reply(tokens, tokenizer.decode(tokens), output.finish_reason == "stop",
                     output.usage.cached_tokens)

    return ask


def theirs(model_dir: Path, turns: int, system: str, message, tokenizer: Any,
           prefill_step: int) -> list[float]:
    """TTFT per turn of mlx-lm's generate, resuming the previous prompt's cache."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, _ = load(str(model_dir))
    sampler = make_sampler(0.0)
    ttft: list[float] = []
    kept: dict[str, Any] = {"tokens": [], "cache": None}

    def ask(messages: list[dict[str, str]], prompt: list[int]) -> Reply:
        started = time.perf_counter()
        held = kept["tokens"]
        if kept["cache"] is not None and prompt[:len(held)] == held and len(held) < len(prompt):
            cache, start = copy.deepcopy(kept["cache"]), len(held)
        else:
            cache, start = make_prompt_cache(model), 0
        rest = prompt[start:-1]
        for at in range(0, len(rest), prefill_step):
            model(mx.array(rest[at:at + prefill_step])[None], cache=cache)
            mx.eval([c.state for c in cache])
        kept["tokens"], kept["cache"] = prompt[:-1], copy.deepcopy(cache)
        tokens: list[int] = []
        for response in stream_generate(model, tokenizer, prompt[-1:], prompt_cache=cache,
                                        max_tokens=TINY_CONTEXT.answer_tokens, sampler=sampler):
            if not tokens:
                ttft.append(time.perf_counter() - started)
            tokens.append(response.token)
            if response.finish_reason is not None:
                break
        stopped = bool(tokens) and tokens[-1] in tokenizer.eos_token_ids
        answer = tokens[:-1] if stopped else tokens
        return Reply(answer, tokenizer.decode(answer), stopped, start)

    converse(ask, tokenizer, turns=turns, system_prompt=system, message=message)
    return ttft


def _spread(values: Sequence[float], digits: int = 3) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_turns_inprocess",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_next,gpt_oss",
                        help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--out", type=Path, help=f"write the markdown report here (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families or args.rounds < 1 or args.turns < 2:
        raise SystemExit(f"--families takes {', '.join(FAMILIES)} (not {unknown}); "
                         "--rounds >= 1; --turns >= 2")

    from mlx_lm.utils import load_tokenizer

    from omlx_core.bench.serving import settings_for
    from omlx_core.testing import cached_model

    settings = settings_for(None, [])
    tier, prefill_step = settings.tier, settings.prefill_step_size
    load = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="omlx-agent-inprocess-"))
    sections = []
    try:
        for family in families:
            model_dir = Path(cached_model(family, 0, cache_dir=workdir)).resolve()
            tokenizer = load_tokenizer(model_dir)
            system = text_of_tokens(model_dir, TINY_CONTEXT.system_tokens, seed=35,
                                    heading="You are an agent. Follow these rules.")
            message = with_tool_output(model_dir, TINY_CONTEXT.tool_tokens)
            rounds: list[Round] = []
            for index in range(args.rounds):
                print(f"{family}: round {index + 1} of {args.rounds}", flush=True)
                runs: dict[str, Any] = {}
                for side in (SIDES if index % 2 == 0 else SIDES[::-1]):
                    runs[side] = (theirs(model_dir, args.turns, system, message, tokenizer,
                                         prefill_step) if side == "mlx-lm" else
                                  ours(model_dir, args.turns, system, message, tokenizer, tier,
                                       ssd=side == "engine + SSD tier"))
                rounds.append(Round(runs["engine"][0], runs["engine + SSD tier"][0],
                                    runs["engine"][1], runs["mlx-lm"]))
            sections.append(render_family(family, rounds, args.turns))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    header = [
        "# Agent turns in this process: omlx-core's engine against mlx-lm's generate",
        "",
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average before {load[0]:.2f}; {args.rounds} round(s) of "
        f"{args.turns} turns per family and side, the order alternating",
        f"- omlx-core: the engine as `serve` builds it, tier `{tier}` (picked for this machine), "
        "no override; without an SSD tier, and with one in a new directory (as `serve` starts "
        "it); mlx-lm: `stream_generate` resuming a copy of the previous "
        f"prompt's cache less its last token (what mlx_lm.server keeps), prefill step {prefill_step}",
        f"- system prompt {TINY_CONTEXT.system_tokens} tokens, tool output "
        f"{TINY_CONTEXT.tool_tokens} tokens a turn, answers up to {TINY_CONTEXT.answer_tokens} "
        "tokens; TTFT: request to first token; cells: median over rounds (lowest-highest)",
    ]
    publish_report("\n".join(header + [""] + sections),
                   args.out if args.out is not None else DEFAULT_OUT)
    return 0


def render_family(family: str, rounds: list[Round], turns: int) -> str:
    lines = [f"## {family}", "",
             "| turn | engine TTFT (s) | engine + SSD tier TTFT (s) | mlx-lm TTFT (s) | engine / mlx-lm "
             "| engine + SSD tier / mlx-lm | engine prefill forwards |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for turn in range(turns):
        plain = [r.engine[turn] for r in rounds]
        tiered = [r.tiered[turn] for r in rounds]
        peer = [r.peer[turn] for r in rounds]
        forwards = sorted({r.forwards[turn] for r in rounds})
        lines.append(f"| {turn + 1} | {_spread(plain)} | {_spread(tiered)} | {_spread(peer)} | "
                     f"{_spread([a / b for a, b in zip(plain, peer)], 2)} | "
                     f"{_spread([a / b for a, b in zip(tiered, peer)], 2)} | "
                     f"{', '.join(map(str, forwards))} |")
    alone = [sum(r.engine[1:]) / sum(r.peer[1:]) for r in rounds]
    tier = [sum(r.tiered[1:]) / sum(r.peer[1:]) for r in rounds]
    lines += ["", f"Turns 2-{turns}, summed TTFT over mlx-lm's (median of rounds, range): engine "
              f"**{_spread(alone, 2)}**, engine + SSD tier **{_spread(tier, 2)}**", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
