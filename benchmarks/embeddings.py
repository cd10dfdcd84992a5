"""Embeddings on the shipped model (all-MiniLM-L6-v2): throughput with and without
batching, how close it comes to the machine's matmul speed, and an embedding client
beside eight chat streams under one memory ceiling.

Every server is ``omlx-core serve`` as the README starts it (the default chat model and
the shipped embedding model); what a run adds is printed in the report.

1. **Throughput**: 1,000 short texts (sentences of 4-10 words, 6-14 tokens with [CLS] and
   [SEP], like the documented "A man is eating food.") and 100 texts of ~256 tokens, sent by
   1 and by 8 concurrent clients (32 and 8 texts per request), against two servers up
   at once: the default one, and a peer given ``--set plugin.encoder.max_batch_rows=1``
   (one text per forward). The two alternate, ``--rounds`` times (>= 3); medians and
   spread of texts/s, and the batching gain (default / one per forward).
2. **Against the machine**: tokens/s of the batched runs as a share of what the model's
   FLOPs per token would give at the matmul speed measured here (float32, the model's own
   shapes, the same BLAS the servers preload); and, in this process, what batching can
   give at most: one text's forward against its share of a batched forward's matmuls
   alone (:class:`Ceiling`), beside the engine's own gain without serving.
3. **Mixed load under one ceiling**: a server with ``--memory-ceiling``; 8 streaming chats
   alone, then the same 8 with an embedding client sending 32 short texts a request
   until they end, alternating ``--rounds`` times. Refusals (any status but 200, any
   in-band error), the server's peak RSS (VmHWM after the warm-up, and sampled), and
   chat tok/s with the client over chat tok/s alone. Targets: no refusal, peak <= the
   ceiling, chat >= 0.8x.
4. ``--peaks``: the encode estimate against ``mx.get_peak_memory()`` of real forwards of
   the model at several batch shapes, in this process (never under: the guard's rule).

    python -m benchmarks.embeddings [--rounds 3] [--ceiling 1.5GiB] [--out docs/embeddings-bench.md]
    python -m benchmarks.embeddings --peaks
    python -m benchmarks.embeddings --quick      # 1 round, 200 short / 20 long texts (smoke)
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.ceiling import PeakRss, reset_peak, status_fields
from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.servers import ServerProcess, ServerSettings, free_port, omlx_spec
from omlx_core.settings import format_size, parse_size

DEFAULT_OUT = Path("docs/embeddings-bench.md")
MODEL = "all-minilm-l6-v2"
ONE_PER_FORWARD = "plugin.encoder.max_batch_rows=1"
WORDS = ("the server keeps a careful account of every byte it hands out before request is "
         "allowed to run engine estimates how much memory prompt will need adds running "
         "requests already hold compares sum with ceiling if can never fit client told at "
         "once numbers explain why small model useful testing loads moment answers quickly "
         "weights random shapes tensors kinds caches way loaded same large quick brown fox "
         "jumps over lazy dog journey thousand miles begins single step water boils hundred "
         "degrees sea level freezes zero capital france paris italy rome japan tokyo").split()


# -- texts ---------------------------------------------------------------------------------------


def texts(count: int, words: tuple[int, int], seed: int) -> list[str]:
    """``count`` sentences of ``words`` (low, high) words each, seeded."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))).capitalize() + "."
            for _ in range(count)]


@dataclass(frozen=True)
class Workload:
    name: str
    texts: list[str]
    per_request: int
    clients: int


def workloads(short: int, long: int) -> list[Workload]:
    short_texts = texts(short, (4, 10), seed=1)
    # ~256 tokens with [CLS]/[SEP]: all-MiniLM-L6-v2 takes 256, these run 230-250 words
    long_texts = texts(long, (190, 205), seed=2)
    return [Workload(f"{short} short", short_texts, 32, 1),
            Workload(f"{short} short", short_texts, 32, 8),
            Workload(f"{long} of ~256 tokens", long_texts, 8, 1),
            Workload(f"{long} of ~256 tokens", long_texts, 8, 8)]


# -- a client --------------------------------------------------------------------------------------


def post(port: int, path: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def embed(port: int, batch: list[str]) -> int:
    """Embed ``batch``; its prompt tokens (raises on any status but 200)."""
    status, body = post(port, "/v1/embeddings", {"model": MODEL, "input": batch,
                                                 "truncate": True})
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {json.dumps(body)[:300]}")
    return int(body["usage"]["prompt_tokens"])


@dataclass
class Rate:
    texts_per_s: float
    tokens_per_s: float


def run_workload(port: int, work: Workload) -> Rate:
    """All of ``work``'s texts, split among its clients, each sending its share in
    requests of ``per_request`` texts one after another."""
    shares = [work.texts[i::work.clients] for i in range(work.clients)]

    def client(index: int) -> int:
        mine = shares[index]
        return sum(embed(port, mine[i:i + work.per_request])
                   for i in range(0, len(mine), work.per_request))

    tokens, seconds = run_concurrently(work.clients, client)
    return Rate(len(work.texts) / seconds, sum(tokens) / seconds)


# -- the machine's matmul speed ---------------------------------------------------------------


def matmul_flops(hidden: int, intermediate: int, tokens: int = 2048) -> float:
    """Float32 FLOP/s of the model's own matmul shapes ((tokens x hidden) @ (hidden x
    intermediate) and back), best of several timed repetitions, in this process."""
    import mlx.core as mx

    best = 0.0
    for inner, outer in ((hidden, intermediate), (intermediate, hidden), (hidden, hidden)):
        a = mx.random.normal((tokens, inner))
        b = mx.random.normal((inner, outer))
        mx.eval(a, b)
        mx.eval(a @ b)
        for _ in range(5):
            started = time.perf_counter()
            mx.eval(a @ b)
            best = max(best, 2 * tokens * inner * outer / (time.perf_counter() - started))
    return best


def flops_per_token(config: dict[str, Any], length: float) -> float:
    """A BERT encoder's forward FLOPs per token at sequence ``length``: the four
    attention projections and the two MLP matmuls, and the scores and their weighted sum."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    linear = 4 * hidden * hidden + 2 * hidden * inner
    attention = 2 * length * hidden
    return 2 * config["num_hidden_layers"] * (linear + attention)


@dataclass(frozen=True)
class Ceiling:
    """What batching can give on this machine, measured in this process on the shipped
    model for one workload's texts (milliseconds per text, best of several runs)."""

    workload: str
    one_forward: float  # one text per forward, the whole forward
    batched_forward: float  # the texts of one request in one forward
    batched_matmuls: float  # that forward's matmuls alone (every linear layer, same rows)
    rows: int  # token rows of the batched forward

    @property
    def gain(self) -> float:
        """The engine's own batching gain, without serving."""
        return self.one_forward / self.batched_forward

    @property
    def bound(self) -> float:
        """The most any batching could give: a text's own forward over its share of the
        batched forward's matmuls, as if nothing else in that forward took time."""
        return self.one_forward / self.batched_matmuls


#: timed runs of each part of a :class:`Ceiling`; the best is kept (the machine's speed
#: on a shared host swings by half between runs of the same matmul)
REPEATS = 15


def _best_ms(run: Callable[[], Any], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        started_at = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started_at)
    return best * 1000


def shipped_backbone() -> tuple[Any, dict[str, Any]]:
    """The shipped embedding model loaded in this process as the encoder engine loads it,
    and its config."""
    from omlx_core.models.default_embedding import ensure_default_embedding_model
    from omlx_core.models.registry import spec_for_path
    from omlx_core.plugins.encoder.engine import load_backbone
    from omlx_core.plugins.encoder.layout import read_layout

    spec = spec_for_path(ensure_default_embedding_model(), engine="encoder")
    config = dict(spec.config)
    return load_backbone(spec.path, read_layout(spec.path, config, lambda key: None), config), config


def ceilings(works: Sequence[Workload]) -> list[Ceiling]:
    """:class:`Ceiling` per workload kind (short, long): the first request's texts."""
    import mlx.core as mx
    import mlx.nn as nn

    from omlx_core.plugins.encoder.backbone import PaddedBatch

    backbone, _ = shipped_backbone()
    # The encoder's layers only: a pooler or a classifier head takes no part in embedding.
    linears = [module for name, module in backbone.model.named_modules()
               if isinstance(module, nn.Linear) and name.startswith("encoder.")]
    found: list[Ceiling] = []
    for work in works:
        if any(c.workload == work.name for c in found):
            continue
        inputs = [backbone.tokenize_input(text, "document", None)
                  for text in work.texts[:work.per_request]]
        rows = sum(len(i) for i in inputs)
        batch = PaddedBatch.of(inputs, backbone.pad_id)
        singles = [PaddedBatch.of([i], backbone.pad_id) for i in inputs]
        one = _best_ms(lambda: [backbone.run(s, "embed") for s in singles], REPEATS) / len(inputs)
        together = _best_ms(lambda: backbone.run(batch, "embed"), REPEATS) / len(inputs)
        states = {m.weight.shape[1]: mx.random.normal((rows, m.weight.shape[1])) for m in linears}
        mx.eval(list(states.values()))

        def products() -> None:
            mx.eval([states[m.weight.shape[1]] @ m.weight.T for m in linears])

        matmuls = _best_ms(products, REPEATS) / len(inputs)
        found.append(Ceiling(work.name, one, together, matmuls, rows))
    return found


# -- throughput -------------------------------------------------------------------------------


@dataclass
class Series:
    samples: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def spread(self) -> str:
        return f"{min(self.samples):.1f}-{max(self.samples):.1f}"


def started(overrides: Sequence[str], settings: ServerSettings) -> tuple[ServerProcess, list[str]]:
    port = free_port()
    spec = omlx_spec(None, port, ServerSettings(**{**settings.__dict__,
                                                   "overrides": tuple(overrides)}), MODEL)
    shown = ["omlx-core", "serve", *[part for o in overrides for part in ("--set", o)]]
    return ServerProcess(spec, port), shown


def throughput(settings: ServerSettings, rounds: int, short: int, long: int,
               log: Callable[[str], None]) -> tuple[dict[tuple[str, int, str], Series], list[str]]:
    jobs = workloads(short, long)
    batched, batched_cmd = started([], settings)
    single, single_cmd = started([ONE_PER_FORWARD], settings)
    results: dict[tuple[str, int, str], Series] = {}
    with batched, single:
        for server in (batched, single):
            embed(server.port, ["warm up"])  # the pool loads the model on its first request
        for number in range(rounds):
            order = [("batched", batched), ("one per forward", single)]
            if number % 2:
                order.reverse()
            for work in jobs:
                for label, server in order:
                    rate = run_workload(server.port, work)
                    series = results.setdefault((work.name, work.clients, label), Series())
                    series.samples.append(rate.texts_per_s)
                    series.tokens.append(rate.tokens_per_s)
                    log(f"round {number + 1}: {work.name} x{work.clients} clients, {label}: "
                        f"{rate.texts_per_s:.1f} texts/s")
    return results, [" ".join(batched_cmd), " ".join(single_cmd)]


# -- mixed load ----------------------------------------------------------------------------------


@dataclass
class MixedRound:
    chat_tok_s: float
    refusals: int
    embedded_texts: int = 0


def mixed(settings: ServerSettings, ceiling: str, rounds: int, log: Callable[[str], None]
          ) -> tuple[list[MixedRound], list[MixedRound], int, int, str]:
    from omlx_core.models.default import ensure_default_model

    model_dir = ensure_default_model()
    chat_model = "smollm2-135m-instruct"
    banned = special_token_ids(model_dir)
    messages = [[{"role": "user", "content": f"Write a long story about {topic}."}]
                for topic in ("a lighthouse", "a river", "a robot", "a garden", "a train",
                              "a library", "a mountain", "a violin")]
    port = free_port()
    overrides = ("--memory-ceiling", ceiling)
    spec = omlx_spec(None, port, settings, chat_model)
    spec = type(spec)(spec.name, spec.label, spec.argv + list(overrides), chat_model)
    batch = texts(32, (4, 10), seed=3)
    alone_rounds: list[MixedRound] = []
    with_rounds: list[MixedRound] = []
    with ServerProcess(spec, port) as server:
        stream_chat(server.host, port, chat_body(chat_model, messages[0], 4, banned))
        embed(port, batch)
        reset = reset_peak(server.pid)

        def chats() -> tuple[float, int]:
            def one(index: int) -> Any:
                try:
                    return stream_chat(server.host, port,
                                       chat_body(chat_model, messages[index], 128, banned))
                except RuntimeError as error:
                    return error
            records, seconds = run_concurrently(8, one)
            failed = sum(1 for r in records if isinstance(r, Exception) or not r.complete)
            tokens = sum(r.completion_tokens for r in records if not isinstance(r, Exception))
            return tokens / seconds, failed

        with PeakRss(server.pid, 0.01) as sampled:
            for number in range(rounds):
                rate, failed = chats()
                alone_rounds.append(MixedRound(rate, failed))
                log(f"round {number + 1}: 8 chats alone {rate:.1f} tok/s, {failed} refused")
                stop = threading.Event()
                counts = {"texts": 0, "refused": 0}

                def client() -> None:
                    while not stop.is_set():
                        try:
                            embed(port, batch)
                            counts["texts"] += len(batch)
                        except (RuntimeError, OSError):
                            counts["refused"] += 1

                thread = threading.Thread(target=client, daemon=True)
                thread.start()
                try:
                    rate, failed = chats()
                finally:
                    stop.set()
                    thread.join()
                with_rounds.append(MixedRound(rate, failed + counts["refused"], counts["texts"]))
                log(f"round {number + 1}: 8 chats + embedding client {rate:.1f} tok/s, "
                    f"{counts['texts']} texts embedded, {failed + counts['refused']} refused")
        fields = status_fields(server.pid)
        peak = max(fields.get("VmHWM", 0) if reset else 0, sampled.peak)
    return alone_rounds, with_rounds, peak, parse_size(ceiling), " ".join(
        ["omlx-core", "serve", *overrides])


# -- the estimate against real forwards --------------------------------------------------------------


def peaks() -> str:
    """The encode estimate over measured peaks of real forwards of the shipped model."""
    import mlx.core as mx

    from omlx_core.memory.types import PeakQuery
    from omlx_core.plugins.encoder.backbone import PaddedBatch
    from omlx_core.plugins.estimator import estimate_peak

    backbone, config = shipped_backbone()
    mx.set_cache_limit(0)
    lines = ["| rows x tokens | measured | estimate | estimate / measured |", "|---|---|---|---|"]
    for rows, width in ((1, 8), (1, 256), (32, 16), (256, 16), (16, 128), (32, 256)):
        from omlx_core.encoding import EncodeInput

        batch = PaddedBatch.of([EncodeInput(tuple([101] + [2000] * (width - 2) + [102]))] * rows, 0)
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        backbone.run(batch, "embed")
        measured = mx.get_peak_memory() - base
        estimate = estimate_peak(PeakQuery(model_config=config, new_tokens=width, encode=True,
                                           rows=rows)).total
        lines.append(f"| {rows} x {width} | {format_size(measured)} | {format_size(estimate)} | "
                     f"{estimate / measured:.2f} |")
    return "\n".join(["# The encode estimate against real forwards (all-MiniLM-L6-v2)", "",
                      "mx.get_peak_memory() of one forward, CPU backend, float32", "", *lines, ""])


# -- the report ----------------------------------------------------------------------------------


def render(header: list[str], results: dict[tuple[str, int, str], Series],
           commands: list[str], machine: float, model_config: dict[str, Any],
           bounds: Sequence[Ceiling],
           mixed_result: tuple[list[MixedRound], list[MixedRound], int, int, str] | None) -> str:
    lines = ["# Embeddings: batching, the machine's matmul speed, beside chat", "", *header, "",
             "## Throughput (texts/s, median and range over rounds)", "",
             f"- batched: `{commands[0]}`", f"- one text per forward: `{commands[1]}`", "",
             "| texts | clients | batched | one per forward | batching gain | tokens/s | "
             "share of matmul speed |", "|---|---|---|---|---|---|---|"]
    for name, clients in sorted({(k[0], k[1]) for k in results}, key=lambda k: (k[0], k[1])):
        fast = results[(name, clients, "batched")]
        slow = results[(name, clients, "one per forward")]
        length = statistics.median(fast.tokens) / fast.median
        achieved = statistics.median(fast.tokens) * flops_per_token(model_config, length)
        lines.append(f"| {name} | {clients} | {fast.median:.1f} ({fast.spread()}) | "
                     f"{slow.median:.1f} ({slow.spread()}) | {fast.median / slow.median:.1f}x | "
                     f"{statistics.median(fast.tokens):.0f} | {achieved / machine:.0%} |")
    lines += ["", f"Matmul speed measured here: {machine / 1e9:.1f} GFLOP/s float32 (the "
              "model's shapes, best of 5); share = tokens/s x FLOPs per token (projections, "
              "MLP, attention at the texts' mean length) / that.", ""]
    if bounds:
        lines += ["## What batching can give on this machine (measured in this process)", "",
                  "One request's texts (32 short or 8 long), milliseconds per text, best of "
                  f"{REPEATS}: each text in its own forward; all of them in one forward; and "
                  "that forward's matmuls alone (every linear layer at the same token rows, "
                  "nothing else). "
                  "**bound** = one text's forward over its share of those matmuls: the gain "
                  "batching would give if everything but the matmuls were free in the batched "
                  "forward and serving cost nothing.", "",
                  "| texts | token rows | one per forward | batched forward | its matmuls alone | "
                  "engine's gain | bound |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c.workload} | {c.rows} | {c.one_forward:.2f} | {c.batched_forward:.2f} | "
                  f"{c.batched_matmuls:.2f} | {c.gain:.2f}x | {c.bound:.2f}x |" for c in bounds]
        lines.append("")
    if mixed_result is not None:
        alone, beside, peak, ceiling, command = mixed_result
        chat_alone = statistics.median(r.chat_tok_s for r in alone)
        chat_beside = statistics.median(r.chat_tok_s for r in beside)
        refused = sum(r.refusals for r in alone + beside)
        lines += ["## Mixed load under one ceiling", "", f"- `{command}`", "",
                  "| | median | range |", "|---|---|---|",
                  f"| 8 chats alone, tok/s | {chat_alone:.1f} | "
                  f"{min(r.chat_tok_s for r in alone):.1f}-{max(r.chat_tok_s for r in alone):.1f} |",
                  f"| 8 chats + embedding client, tok/s | {chat_beside:.1f} | "
                  f"{min(r.chat_tok_s for r in beside):.1f}-{max(r.chat_tok_s for r in beside):.1f} |",
                  f"| texts embedded beside the chats | "
                  f"{statistics.median(r.embedded_texts for r in beside):.0f} | "
                  f"{min(r.embedded_texts for r in beside)}-{max(r.embedded_texts for r in beside)} |",
                  "", f"- chat with the client / alone: **{chat_beside / chat_alone:.2f}x** "
                  "(target >= 0.8x)",
                  f"- refusals of work that fits: **{refused}** (target 0)",
                  f"- peak RSS: **{format_size(peak)}** against the {format_size(ceiling)} ceiling "
                  f"({'within' if peak <= ceiling else 'OVER'})", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--ceiling", default="1.5GiB",
                        help="--memory-ceiling of the mixed-load server (default 1.5GiB)")
    parser.add_argument("--quick", action="store_true",
                        help="one round, 200 short and 20 long texts: a smoke run, not figures")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed load")
    parser.add_argument("--peaks", action="store_true",
                        help="only compare the encode estimate with real forwards' peaks")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the report (e.g. {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    if args.peaks:
        publish_report(peaks(), args.out)
        return 0
    from omlx_core.config import load_config
    from omlx_core.models.default_embedding import ensure_default_embedding_model

    rounds, short, long = (1, 200, 20) if args.quick else (args.rounds, 1000, 100)
    model_config = json.loads((ensure_default_embedding_model() / "config.json").read_text())
    config = load_config(None)
    settings = ServerSettings.of_config(config)

    def log(text: str) -> None:
        print(text, flush=True)

    machine = matmul_flops(model_config["hidden_size"], model_config["intermediate_size"])
    bounds = ceilings(workloads(short, long))
    results, commands = throughput(settings, rounds, short, long, log)
    mixed_result = None if args.no_mixed else mixed(settings, args.ceiling, rounds, log)
    load = os.getloadavg()
    header = [f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
              f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
              f"at the end; tier {settings.tier}; model `{MODEL}`",
              f"- {rounds} round(s), the two servers alternating; clients send 32 short or 8 "
              "long texts per request, one request after another"]
    publish_report(render(header, results, commands, machine, model_config, bounds,
                          mixed_result), args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
