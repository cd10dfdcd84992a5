"""What splitting a reply into thinking, content and tool calls costs: 16-stream decode
throughput of one server with the output processor's reasoning and tool parsing on
against the same server, model and prompts with it off.

    python -m benchmarks.reasoning_parse [--rounds 4] [--streams 16] [--max-tokens 128] [--out FILE]

One ``omlx-core serve --config FILE`` (the README's way, the file printed in the report)
serves the default model twice from the same weights under a ChatML template whose
generation prompt opens ``<think>`` (``enable_thinking=false`` closes it, as Qwen3's):
``parsed`` with ``reasoning_format = "think_tags"``, ``unparsed`` with ``"none"``.
Requests to ``parsed`` carry a tool (``tool_choice: "none"``: rendered in the prompt and
parsed for, never constrained); requests to ``unparsed`` carry the same tool text as a
system message, so both prompts are the same tokens and greedy decoding generates the
same tokens (checked). Two pairs:

- replies that are all thinking: every character scanned for ``</think>``;
- replies that are all content (thinking closed in the prompt): every character through
  the hermes tool-call parser.

The split is also timed alone, on the replies the unparsed server generated, fed in
token-sized pieces as a generation feeds them: its CPU time per token next to the
server's, a figure the machine's load moves far less than throughput.

Each round runs the four variants in a rotating order; end-of-sequence tokens are banned
through ``logit_bias`` so every stream runs to ``--max-tokens``. The cost is the median
over rounds of each pair's per-round throughput ratio (a pair runs back to back, so
slow drifts in the machine's load hit both halves alike).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.servers import ServerProcess, ServerSpec, free_port
from omlx_core.grammar.tool_call_formats import HERMES
from omlx_core.grammar.toolcalls import tool_call_parser
from omlx_core.serving.reasoning import ReplySplitter, ThinkTagSplitter, reasoning_tokens
from omlx_core.serving.tools import HERMES_TOOLS_PROMPT

TARGET_COST = 0.02
PARSED, UNPARSED = "parsed", "unparsed"
# (label, model, thinking closed in the prompt)
VARIANTS = (("thinking, unparsed", UNPARSED, False), ("thinking, parsed", PARSED, False),
            ("content, unparsed", UNPARSED, True), ("content, parsed", PARSED, True))
PAIRS = (("replies all thinking", "thinking, parsed", "thinking, unparsed"),
         ("replies all content (tool-call parser)", "content, parsed", "content, unparsed"))

# ChatML as SmolLM2's template writes it, with a thinking block the generation prompt
# opens, or closes empty when the caller says enable_thinking=false.
THINKING_CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOPICS = ("a lighthouse keeper", "a clockmaker", "a river", "a mountain village", "a robot",
          "a library at night", "a desert caravan", "an old ship", "a winter garden", "a city",
          "a violin", "a glacier", "a market", "a comet", "a beekeeper", "a train station")


def thinking_model(model_dir: Path, into: Path) -> Path:
    """The default model's files, linked, under :data:`THINKING_CHATML`."""
    into.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "tokenizer_config.json":
            (into / item.name).symlink_to(item.resolve())
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = THINKING_CHATML
    (into / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return into


def request(variant: tuple[str, str, bool], round_index: int, stream: int, max_tokens: int,
            banned: Sequence[int]) -> dict:
    _, model, closed = variant
    ask = {"role": "user", "content": f"Tell me a short story about {TOPICS[stream % len(TOPICS)]} "
                                      f"(take {round_index + 1})."}
    if model == PARSED:
        body = chat_body(model, [ask], max_tokens, banned)
        body.update(tools=[TOOL], tool_choice="none")
    else:  # the same prompt: the text the pipeline renders the tool as, sent as-is
        system = HERMES_TOOLS_PROMPT.format(tools=json.dumps(TOOL))
        body = chat_body(model, [{"role": "system", "content": system}, ask], max_tokens, banned)
    if closed:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def server_cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the server process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parser_us_per_token(texts: Sequence[str], tokens: Sequence[int], *, inside: bool,
                        repeats: int = 20) -> float:
    """CPU microseconds per token the output processor's split takes alone: ``texts``
    (replies of ``tokens`` tokens each) fed in token-sized pieces through a thinking
    splitter and the hermes tool-call parser, as a generation feeds them."""
    started = time.process_time()
    for _ in range(repeats):
        for text, count in zip(texts, tokens):
            size = max(1, round(len(text) / max(1, count)))
            splitter = ReplySplitter(thinking=ThinkTagSplitter(inside=inside), tools=tool_call_parser(HERMES))
            for start in range(0, len(text), size):
                splitter.feed(text[start:start + size])
            splitter.finish()
            reasoning_tokens(list(range(0, len(text), size)), splitter.reasoning_spans())
    return 1e6 * (time.process_time() - started) / (repeats * sum(tokens))


def measure(server: ServerProcess, variant: tuple[str, str, bool], round_index: int, streams: int,
            max_tokens: int, banned: Sequence[int]) -> tuple[float, float, list[int], list[int], list[str]]:
    """Aggregate tokens/s of ``streams`` concurrent requests, the server's CPU ms per
    completion token (the parsing runs on its request threads; CPU time moves less with
    the machine's load than wall time), and each request's completion and prompt tokens."""
    bodies = [request(variant, round_index, i, max_tokens, banned) for i in range(streams)]
    cpu_before = server_cpu_seconds(server.pid)
    records, seconds = run_concurrently(streams, lambda i: stream_chat(server.host, server.port, bodies[i]))
    tokens = sum(r.completion_tokens for r in records)
    return (tokens / seconds, 1000 * (server_cpu_seconds(server.pid) - cpu_before) / tokens,
            [r.completion_tokens for r in records], [r.prompt_tokens or 0 for r in records],
            [r.text for r in records])


def run(args: argparse.Namespace) -> int:
    from omlx_core.models.default import ensure_default_model

    model_dir = Path(ensure_default_model()).resolve()
    banned = special_token_ids(model_dir)
    work = Path(tempfile.mkdtemp(prefix="omlx-reasoning-parse-"))
    served = thinking_model(model_dir, work / "smollm2-thinking")
    config_text = (f'[server]\nmodels = ["{PARSED}", "{UNPARSED}"]\n\n'
                   f'[models.{PARSED}]\npath = "{served}"\nreasoning_format = "think_tags"\n\n'
                   f'[models.{UNPARSED}]\npath = "{served}"\nreasoning_format = "none"\n')
    config = work / "omlx.toml"
    config.write_text(config_text)
    port = free_port()
    argv = [sys.executable, "-m", "omlx_core", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--config", str(config)]
    spec = ServerSpec("omlx-core", "omlx-core serve --config FILE", argv, model_id=PARSED)
    rates: dict[str, list[float]] = {label: [] for label, _, _ in VARIANTS}
    cpu_ms: dict[str, list[float]] = {label: [] for label, _, _ in VARIANTS}
    replies: dict[str, tuple[list[str], list[int]]] = {}
    loads = [_load_average()]
    with ServerProcess(spec, port) as server:
        for variant in VARIANTS:  # warm up: every model, both prompts, compiled kernels
            measure(server, variant, -1, 2, 8, banned)
        for round_index in range(args.rounds):
            shift = round_index % len(VARIANTS)
            seen: dict[str, tuple[list[int], list[int]]] = {}
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                rate, cpu, completions, prompts, texts = measure(server, variant, round_index,
                                                                 args.streams, args.max_tokens, banned)
                if variant[1] == UNPARSED:  # its replies' text is all content: the raw text
                    replies[variant[0]] = (texts, completions)
                rates[variant[0]].append(rate)
                cpu_ms[variant[0]].append(cpu)
                seen[variant[0]] = (completions, prompts)
            for _, parsed, unparsed in PAIRS:
                if seen[parsed] != seen[unparsed]:
                    raise RuntimeError(f"{parsed} and {unparsed} did not run the same tokens: "
                                       f"(completion, prompt) tokens {seen[parsed]} vs {seen[unparsed]}")
            loads.append(_load_average())
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; {args.rounds} rounds, variant order rotated each round",
        f"- load average (1, 5, 15 min) before and after each round: {'; '.join(loads)}",
        f"- server: `omlx-core serve --config FILE`, no other flag; the file (model `{model_dir.name}`, "
        "linked under a template whose generation prompt opens `<think>`):",
        "", "```toml", config_text.rstrip().replace(str(served), "<linked default model>"), "```", "",
        f"- {args.streams} concurrent greedy streaming chats per variant, end-of-sequence tokens banned, "
        f"{args.max_tokens} tokens each; tokens/s: completion tokens over wall time, first request "
        "to last token; each pair checked to generate the same completion and prompt tokens",
    ]
    alone = {title: parser_us_per_token(*replies[unparsed], inside=unparsed.startswith("thinking"))
             for title, _, unparsed in PAIRS}
    publish_report(render(rates, cpu_ms, alone, header), args.out)
    return 0


def render(rates: dict[str, list[float]], cpu_ms: dict[str, list[float]], alone: dict[str, float],
           header: Sequence[str]) -> str:
    lines = ["## Reasoning and tool-call parsing: cost to decode throughput", "", *header, "",
             "| replies | parsed tok/s | unparsed tok/s | parsed / unparsed (median, min-max) | "
             f"throughput cost (target ≤ {TARGET_COST:.0%}) | server CPU ms/token parsed / unparsed | "
             "CPU cost | the split alone: µs/token (of the server's CPU per token) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for title, parsed, unparsed in PAIRS:
        ratios = [p / u for p, u in zip(rates[parsed], rates[unparsed])]
        cpu_ratios = [p / u for p, u in zip(cpu_ms[parsed], cpu_ms[unparsed])]
        ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)
        lines.append(f"| {title} | {statistics.median(rates[parsed]):.1f} | "
                     f"{statistics.median(rates[unparsed]):.1f} | {ratio:.3f}x "
                     f"({min(ratios):.3f}-{max(ratios):.3f}) | {1 - ratio:+.1%} "
                     f"({'met' if 1 - ratio <= TARGET_COST else 'missed'}) | "
                     f"{statistics.median(cpu_ms[parsed]):.2f} / {statistics.median(cpu_ms[unparsed]):.2f} | "
                     f"{cpu_ratio - 1:+.1%} ({min(cpu_ratios) - 1:+.1%} to {max(cpu_ratios) - 1:+.1%}) | "
                     f"{alone[title]:.1f} ({alone[title] / 1000 / statistics.median(cpu_ms[unparsed]):.3%}) |")
    lines += ["", "Per round, tokens/s (server CPU ms per token): " + "; ".join(
        f"{label} " + " / ".join(f"{r:.1f} ({c:.1f})" for r, c in zip(values, cpu_ms[label]))
        for label, values in rates.items())]
    return "\n".join(lines) + "\n"


def _load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reasoning_parse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
