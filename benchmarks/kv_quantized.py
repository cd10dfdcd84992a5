"""A quantized KV cache against full precision on the default model, in one run.

Three measurements, each printed as a table:

1. **Capacity under one ceiling.** A server per KV format (``--kv-bits 0``, ``8``, ``4``),
   each started as ``./setup.sh serve`` starts it plus ``--memory-ceiling`` and
   ``--kv-bits`` (the only flags added, printed). A ~4k-token conversation is sent once
   (its prefix is then cached), then 16 continuations of it at once (the conversation
   plus a different question each, 24 tokens answered): the most requests holding KV at
   once (prefilling or decoding, ``/health`` sampled every 20 ms) is how many 4k-token
   conversations that ceiling admits together. Every request must complete (0 refusals
   of work that fits) and the server's peak RSS stay under the ceiling.
2. **Perplexity** of the default model on a fixed ~2.2k-token text
   (``benchmarks/data/perplexity.txt``), prefilled in 256-token chunks into a cache of
   each format, as the engine prefills: every position's next-token log-likelihood.
3. **Decode tok/s at 8 streams**: ``omlx-core serve``, ``omlx-core serve --kv-bits 8``
   and ``--kv-bits 4`` alternating over rounds (the order turning each round), 8 concurrent streams of 128 tokens (special tokens banned on
   both, so every stream runs to its length); decode rate is each stream's tokens after
   its first over the time from its first to its last; medians of the per-round ratios.

Targets (issue 33): conversations with 8-bit KV >= 1.8x full precision's, 4-bit >= 3x;
perplexity within 1 % (8-bit) and 5 % (4-bit); 8-stream decode with 8-bit >= 0.9x
(4-bit's is printed beside it, with no target: its keys are expanded from their tiles
every step).

    python -m benchmarks.kv_quantized [--ceiling 1.5GiB] [--rounds 3]
        [--parts capacity,perplexity,decode] [--out docs/kv-bench.md]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from benchmarks.ceiling import PeakRss, reset_peak, status_fields
from benchmarks.kv_formats import CHUNK, perplexity_over
from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.prompts import text_of_tokens
from omlx_core.bench.servers import ServerProcess, ServerSettings, free_port, omlx_spec
from omlx_core.settings import format_size, parse_size

DEFAULT_OUT = Path("docs/kv-bench.md")
TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
FORMATS = (0, 8, 4)
#: what the benchmark measures, each on its own (``--parts``)
PARTS = ("capacity", "perplexity", "decode")
CONVERSATION_TOKENS = 4000
CONTINUATIONS = 16
ANSWER_TOKENS = 24
STREAMS = 8
STREAM_TOKENS = 128


# -- 1. capacity ------------------------------------------------------------------------

@dataclass
class Capacity:
    bits: int
    argv: list[str]
    statuses: dict[str, int] = field(default_factory=dict)
    most_held: int = 0
    peak_bytes: int = 0
    idle_bytes: int = 0
    wall_s: float = 0.0


def _health(host: str, port: int) -> dict[str, Any]:
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def capacity(bits: int, ceiling: str, settings: ServerSettings, model_dir: Path,
             served_id: str, banned: Sequence[int]) -> Capacity:
    port = free_port()
    spec = omlx_spec(None, port, settings, served_id)
    argv = spec.argv + ["--memory-ceiling", ceiling, "--kv-bits", str(bits)]
    spec = type(spec)(spec.name, spec.label, argv, spec.model_id)
    run = Capacity(bits, spec.typed())
    conversation = text_of_tokens(model_dir, CONVERSATION_TOKENS, seed=4)
    system = {"role": "system", "content": "Answer from this record.\n" + conversation}
    with ServerProcess(spec, port) as server:
        stream_chat(server.host, port, chat_body(served_id, [system, {"role": "user",
                    "content": "Which rule comes first?"}], 4, banned))
        run.idle_bytes = status_fields(server.pid)["VmRSS"]
        reset = reset_peak(server.pid)
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                engines = _health(server.host, port).get("engines", {})
                held = sum(int(e.get("running", 0)) + int(e.get("prefilling", 0))
                           for e in engines.values())
                run.most_held = max(run.most_held, held)
                done.wait(0.02)

        def one(index: int) -> str:
            question = {"role": "user", "content": f"What does rule {index + 1} say, and why?"}
            try:
                record = stream_chat(server.host, port,
                                     chat_body(served_id, [system, question], ANSWER_TOKENS, banned))
            except RuntimeError as error:
                text = str(error)
                return text.split()[1] if text.startswith("HTTP ") else "in-band error"
            return "200" if record.complete else "truncated"

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with PeakRss(server.pid, 0.005) as sampled:
            outcomes, run.wall_s = run_concurrently(CONTINUATIONS, one)
        done.set()
        watcher.join()
        for status in outcomes:
            run.statuses[status] = run.statuses.get(status, 0) + 1
        fields = status_fields(server.pid)
        run.peak_bytes = max(fields.get("VmHWM", 0) if reset else 0, sampled.peak)
    return run


# -- 2. perplexity ----------------------------------------------------------------------

def perplexities(model_dir: Path) -> tuple[int, dict[int, float]]:
    """Tokens scored, and the perplexity of the text for each KV format."""
    from omlx_core.mlx_thread import mlx_thread
    from omlx_core.scheduling import KVFormat, load_model, make_request_cache

    def run() -> tuple[int, dict[int, float]]:
        model, tokenizer = load_model(model_dir)
        tokens = tokenizer.encode(TEXT.read_text(encoding="utf-8"))
        results = {bits: perplexity_over(model, tokens, make_request_cache(model, KVFormat.from_settings(bits, 64)))
                   for bits in FORMATS}
        return len(tokens) - 1, results

    return mlx_thread().run(run)


# -- 3. decode rate -----------------------------------------------------------------------

def decode_rate(bits: int, settings: ServerSettings, model_dir: Path, served_id: str,
                banned: Sequence[int]) -> tuple[list[str], float]:
    """The command, and the median decode tok/s of 8 concurrent streams."""
    port = free_port()
    spec = omlx_spec(None, port, settings, served_id)
    argv = spec.argv + (["--kv-bits", str(bits)] if bits else [])
    spec = type(spec)(spec.name, spec.label, argv, spec.model_id)
    prompts = [text_of_tokens(model_dir, 300, seed=50 + i) for i in range(STREAMS)]
    with ServerProcess(spec, port) as server:
        stream_chat(server.host, port, chat_body(served_id, [{"role": "user", "content": "Hello"}],
                                                 8, banned))

        def one(index: int) -> float:
            record = stream_chat(server.host, port, chat_body(
                served_id, [{"role": "user", "content": "Go on:\n" + prompts[index]}],
                STREAM_TOKENS, banned))
            span = record.chunk_times[-1] - record.chunk_times[0]
            return (len(record.chunk_times) - 1) / span if span > 0 else 0.0

        rates, _ = run_concurrently(STREAMS, one)
    return spec.typed(), sum(rates)


# -- the report -------------------------------------------------------------------------

def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def render(header: Sequence[str], runs: Sequence[Capacity], ceiling: int, scored: int,
           ppl: dict[int, float], decode: list[dict[int, float]], argv: dict[int, list[str]]
           ) -> str:
    lines = ["# Quantized KV cache against full precision", "", *header]
    if runs:
        lines += _capacity_table(runs, ceiling)
    if ppl:
        lines += _perplexity_table(scored, ppl)
    if decode:
        lines += _decode_table(decode, argv)
    return "\n".join(lines) + "\n"


def _capacity_table(runs: Sequence[Capacity], ceiling: int) -> list[str]:
    full = next(r for r in runs if r.bits == 0)
    lines = ["", f"## 4k-token conversations admitted together under a {format_size(ceiling)} ceiling",
             "", "| server | held at once | vs full precision | completed | peak RSS | idle RSS | wall s |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for run in runs:
        ratio = run.most_held / full.most_held if full.most_held else float("nan")
        statuses = ", ".join(f"{s} x{n}" for s, n in sorted(run.statuses.items()))
        mark = "<=" if run.peak_bytes <= ceiling else "> (over!)"
        lines.append(f"| `{' '.join(run.argv)}` | {run.most_held} | {ratio:.2f}x | {statuses} | "
                     f"{format_size(run.peak_bytes)} {mark} | {format_size(run.idle_bytes)} | "
                     f"{run.wall_s:.1f} |")
    return lines


def _perplexity_table(scored: int, ppl: dict[int, float]) -> list[str]:
    lines = ["", f"## Perplexity on `benchmarks/data/perplexity.txt` ({scored} tokens scored, "
                 f"{CHUNK}-token prefill chunks)", "",
             "| KV cache | perplexity | vs full precision |", "|---|---:|---:|"]
    from omlx_core.scheduling import KVFormat

    for bits in FORMATS:
        name = KVFormat.from_settings(bits, 64).describe("full precision (float32)")
        lines.append(f"| {name} | {ppl[bits]:.4f} | {100 * (ppl[bits] / ppl[0] - 1):+.2f} % |")
    return lines


def _decode_table(decode: list[dict[int, float]], argv: dict[int, list[str]]) -> list[str]:
    quantized = [bits for bits in FORMATS if bits]
    lines = ["", f"## Decode tok/s at {STREAMS} streams ({STREAM_TOKENS} tokens each), "
                 f"servers alternating, {len(decode)} rounds", "",
             "| round | " + " | ".join(f"`{' '.join(argv[bits])}`" for bits in FORMATS) + " | "
             + " | ".join(f"{bits}-bit / full" for bits in quantized) + " |",
             "|---:|" + "---:|" * (len(FORMATS) + len(quantized))]
    for number, rates in enumerate(decode, 1):
        lines.append(f"| {number} | " + " | ".join(f"{rates[bits]:.1f}" for bits in FORMATS) + " | "
                     + " | ".join(f"{rates[bits] / rates[0]:.2f}x" for bits in quantized) + " |")
    lines.append("")
    for bits in quantized:
        ratios = [rates[bits] / rates[0] for rates in decode if rates[0]]
        target = " (target >= 0.9x)" if bits == 8 else " (no target)"
        lines.append(f"- {bits}-bit over full precision, median (spread): {_spread(ratios)}{target}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_quantized", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ceiling", default="1.5GiB",
                        help="the --memory-ceiling of the capacity servers (default 1.5GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="decode-rate rounds (default 3)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which parts to run, comma-separated (default {','.join(PARTS)})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where to write the report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts or parts - set(PARTS):
        parser.error(f"--parts takes some of {', '.join(PARTS)}; got {args.parts!r}")
    # The perplexity runs in this process: mlx's bundled reference BLAS is ~80x slower.
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model

    ceiling = parse_size(args.ceiling)
    model_dir = ensure_default_model()
    config = load_config(None)
    served_id = config["server.models"][0]
    settings = ServerSettings.of_config(config)
    banned = special_token_ids(model_dir)
    header = [
        f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start; "
        f"model `{model_dir.name}` (float32 weights and activations)",
        "- every server started as `./setup.sh serve` starts it; the flags added are in each "
        "row's command (`--kv-bits 0` is the default, full precision)",
        f"- capacity: one {CONVERSATION_TOKENS}-token conversation sent first (then cached), "
        f"then {CONTINUATIONS} continuations of it at once, {ANSWER_TOKENS} tokens each; "
        "'held at once': most requests prefilling or decoding together (`/health`, every "
        "20 ms); peak RSS: the server's VmHWM after the first request, and RSS every 5 ms",
    ]
    def progress(text: str) -> None:
        print(f"[{datetime.datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)

    runs = []
    for bits in FORMATS if "capacity" in parts else ():
        progress(f"capacity under {args.ceiling}, --kv-bits {bits}")
        runs.append(capacity(bits, args.ceiling, settings, model_dir, served_id, banned))
    scored, ppl = 0, {}
    if "perplexity" in parts:
        progress("perplexity of each KV format")
        scored, ppl = perplexities(model_dir)
    decode: list[dict[int, float]] = []
    commands: dict[int, list[str]] = {}
    for number in range(args.rounds if "decode" in parts else 0):
        turn = number % len(FORMATS)
        rates = {}
        for bits in FORMATS[turn:] + FORMATS[:turn]:
            progress(f"decode rate, round {number + 1}/{args.rounds}, --kv-bits {bits}")
            commands[bits], rates[bits] = decode_rate(bits, settings, model_dir, served_id, banned)
        decode.append(rates)
    publish_report(render(header, runs, ceiling, scored, ppl, decode, commands), args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
