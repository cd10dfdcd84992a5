"""What the HTTP layer costs: aggregate decode throughput of N concurrent streams over
loopback HTTP (SSE through waitress, the full request path) against the same serving
pipeline driven in-process (what an embedding program gets), in one run, same model,
same prompts' shape.

    python -m benchmarks.http_cost [--model DIR] [--streams 8] [--max-tokens 128]

Rounds come in pairs, one of each path back to back, in alternating order (engine
first, then HTTP first), and the cost is the median of the pairs' ratios: load from
other processes drifts slowly, so it hits both halves of a pair alike. Each round uses
prompts of its own, so the prefix cache helps neither path. End-of-sequence
tokens are banned through ``logit_bias`` so every stream generates exactly
``--max-tokens`` tokens in both paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from omlx_core.bench.client import (BANNED_BIAS, chat_body, run_concurrently,
                                    special_token_ids, stream_chat)
from omlx_core.engine import SamplingParams
from omlx_core.serving import Job, ServingPipeline

TARGET_COST = 0.05
ENGINE_PATH = "serving pipeline (in-process)"
HTTP_PATH = "HTTP + SSE (loopback)"
TOPICS = ("a lighthouse keeper", "a clockmaker", "a river", "a mountain village", "a robot",
          "a library at night", "a desert caravan", "an old ship", "a winter garden", "a city")


SERVER_THREAD_PREFIXES = ("waitress-", "omlx-http", "omlx-disconnects")


@dataclass
class Round:
    path: str
    pair: int
    streams: int
    tokens: int
    seconds: float
    ttft_s: float
    #: CPU seconds of the whole process, of the HTTP server's threads, of the client threads
    cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _server_threads_cpu() -> float:
    """CPU seconds used so far by waitress's workers and event loop and our watcher."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.ident is None or not thread.name.startswith(SERVER_THREAD_PREFIXES):
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return total


def _messages(round_index: int, stream: int) -> list[dict[str, str]]:
    topic = TOPICS[stream % len(TOPICS)]
    return [{"role": "user", "content": f"Story {round_index}.{stream}: write a long story "
                                        f"about {topic}."}]


def _run_concurrently(streams: int, work: Callable[[int], tuple[int, float]]
                      ) -> tuple[int, float, float, dict[str, float]]:
    """Start ``work(i)`` on ``streams`` threads at once.

    :returns: tokens, wall seconds, mean TTFT, and CPU seconds (``process``, ``server``,
        ``client``) spent meanwhile.
    """
    client_cpu = [0.0] * streams

    def timed(index: int) -> tuple[int, float]:
        started = time.thread_time()
        try:
            return work(index)
        finally:
            client_cpu[index] = time.thread_time() - started

    cpu_before, server_before = time.process_time(), _server_threads_cpu()
    results, elapsed = run_concurrently(streams, timed)
    cpu = {"process": time.process_time() - cpu_before,
           "server": _server_threads_cpu() - server_before, "client": sum(client_cpu)}
    tokens = sum(r[0] for r in results)
    ttft = statistics.mean(r[1] for r in results)
    return tokens, elapsed, ttft, cpu


def engine_round(pipeline: ServingPipeline, model_id: str, round_index: int, streams: int,
                 sampling: SamplingParams) -> Round:
    def work(index: int) -> tuple[int, float]:
        started = time.perf_counter()
        generation = pipeline.start(Job(model_id, sampling, messages=_messages(round_index, index)))
        first = time.perf_counter() - started
        try:
            for _delta in generation.deltas():
                pass
        finally:
            generation.close()
        if generation.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request ended with {generation.finish_reason}: {generation.error}")
        return generation.completion_tokens, first

    tokens, seconds, ttft, cpu = _run_concurrently(streams, work)
    return Round(ENGINE_PATH, round_index // 2, streams, tokens, seconds, ttft, cpu["process"],
                 cpu["server"], cpu["client"])


def http_round(host: str, port: int, model_id: str, round_index: int, streams: int,
               sampling: SamplingParams) -> Round:
    def work(index: int) -> tuple[int, float]:
        body = chat_body(model_id, _messages(round_index, index), sampling.max_tokens,
                         temperature=sampling.temperature)
        body["logit_bias"] = {str(k): v for k, v in sampling.logit_bias.items()}
        record = stream_chat(host, port, body, timeout=600)
        # A warm-up stream may end on end-of-sequence before any text.
        return record.completion_tokens, record.ttft if record.chunk_times else 0.0

    tokens, seconds, ttft, cpu = _run_concurrently(streams, work)
    return Round(HTTP_PATH, round_index // 2, streams, tokens, seconds, ttft, cpu["process"],
                 cpu["server"], cpu["client"])


def format_table(rounds: Sequence[Round]) -> str:
    header = ("pair", "path", "streams", "tokens", "seconds", "tokens/s", "mean TTFT s",
              "CPU ms/token", "server ms/token", "client ms/token")
    rows = [(str(r.pair + 1), r.path, str(r.streams), str(r.tokens), f"{r.seconds:.2f}",
             f"{r.tokens_per_s:.1f}", f"{r.ttft_s:.3f}", f"{1000 * r.cpu_s / r.tokens:.2f}",
             f"{1000 * r.server_cpu_s / r.tokens:.3f}", f"{1000 * r.client_cpu_s / r.tokens:.3f}")
            for r in rounds]
    widths = [max(len(h), *(len(row[c]) for row in rows)) for c, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def cpu_cost(rounds: Sequence[Round]) -> tuple[float, float]:
    """(HTTP server CPU per token, as a share of the engine-only CPU per token).

    Load-independent: on a saturated CPU the server's CPU is taken from the engine, so
    its share approximates the throughput it costs, whatever else the machine runs.
    """
    served = [r for r in rounds if r.path == HTTP_PATH]
    alone = [r for r in rounds if r.path == ENGINE_PATH]
    server_per_token = sum(r.server_cpu_s for r in served) / sum(r.tokens for r in served)
    engine_per_token = sum(r.cpu_s for r in alone) / sum(r.tokens for r in alone)
    return server_per_token, server_per_token / engine_per_token


def pair_ratios(rounds: Sequence[Round]) -> list[float]:
    """HTTP tokens/s over engine-only tokens/s, for each back-to-back pair."""
    by_pair: dict[int, dict[str, Round]] = {}
    for r in rounds:
        by_pair.setdefault(r.pair, {})[r.path] = r
    return [p[HTTP_PATH].tokens_per_s / p[ENGINE_PATH].tokens_per_s
            for _, p in sorted(by_pair.items()) if len(p) == 2]


def summarize(rounds: Sequence[Round]) -> tuple[float, float, float]:
    """(median engine tokens/s, median HTTP tokens/s, median per-pair HTTP/engine ratio)."""
    engine = statistics.median(r.tokens_per_s for r in rounds if r.path == ENGINE_PATH)
    served = statistics.median(r.tokens_per_s for r in rounds if r.path == HTTP_PATH)
    return engine, served, statistics.median(pair_ratios(rounds))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", help="configuration tier (default: the one that fits)")
    parser.add_argument("--model", type=Path,
                        help="an mlx-lm model directory (default: the configured default model)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="tokens each stream generates (default 128)")
    parser.add_argument("--pairs", type=int, default=4,
                        help="back-to-back pairs of rounds, one per path (default 4)")
    args = parser.parse_args(argv)

    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    from tqdm import tqdm

    from omlx_core.bootstrap import load_setup, served_models, start_engines, stop_engines
    from omlx_core.http.serve import HTTPServer

    overrides: list[tuple[str, str, str]] = [
        ("plugin.batched.max_batch_size", str(max(args.streams, 1)), "bench")]
    print("override: plugin.batched.max_batch_size=%d (both paths run every stream at once)"
          % max(args.streams, 1))
    setup = load_setup(args.tier, [], overrides)
    model_ids = None
    if args.model is not None:
        model_ids = served_models(setup, [str(args.model)])
    context = start_engines(setup, model_ids, progress=True)
    try:
        model_id, engine = next(iter(context.engines.items()))
        banned = {token: BANNED_BIAS for token in special_token_ids(Path(engine.model.path))}
        sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logit_bias=banned)
        rounds: list[Round] = []
        pipeline = ServingPipeline(context)
        with HTTPServer(context, host="127.0.0.1", port=0,
                        threads=max(args.streams + 2, 4)) as server:
            # Warm-up: first forwards compile kernels and fault weights in.
            engine_round(pipeline, model_id, -1, 2, SamplingParams(temperature=0.0, max_tokens=8))
            http_round(server.host, server.port, model_id, -2, 2,
                       SamplingParams(temperature=0.0, max_tokens=8))
            for pair in tqdm(range(args.pairs), desc="bench pairs", unit="pair"):
                runs = [
                    lambda i: engine_round(pipeline, model_id, i, args.streams, sampling),
                    lambda i: http_round(server.host, server.port, model_id, i, args.streams,
                                         sampling),
                ]
                for offset, run in enumerate(runs if pair % 2 == 0 else runs[::-1]):
                    rounds.append(run(2 * pair + offset))
        engine_rate, http_rate, ratio = summarize(rounds)
        print(f"\nmodel {model_id} ({engine.model.path}), {args.streams} concurrent streams x "
              f"{args.max_tokens} tokens, greedy, tier {setup.config.tier}\n")
        print(format_table(rounds))
        cost = 1.0 - ratio
        verdict = "within" if cost <= TARGET_COST else "OVER"
        ratios = ", ".join(f"{r:.3f}" for r in pair_ratios(rounds))
        server_per_token, server_share = cpu_cost(rounds)
        print(f"\nmedian aggregate tokens/s: engine-only {engine_rate:.1f}, HTTP {http_rate:.1f}")
        print(f"HTTP/engine per pair: {ratios}; median {ratio:.3f} -> HTTP cost "
              f"{100 * cost:+.1f}% ({verdict} the {100 * TARGET_COST:.0f}% target)")
        print(f"HTTP server threads: {1e6 * server_per_token:.0f} us CPU per token = "
              f"{100 * server_share:.2f}% of the engine's CPU per token (load-independent)")
        return 0
    finally:
        stop_engines(context)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
