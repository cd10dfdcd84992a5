"""A long prompt joining running streams: one padded decode batch against decode lanes.

    python -m benchmarks.decode_lanes [--running 8] [--context 300] [--long 5000]

Runs the batched engine's scheduler on the default model (its routes installed, the
``cpu-small`` tier's decode-gap budget) twice, once with every row in one mlx-lm batch
(``decode_lanes=False``: what ``mlx_lm.server`` does, and the distributed engine) and once
with lanes (the default): ``running`` greedy streams of ~``context``-token prompts decode,
then a ``long``-token prompt arrives, is prefilled beside them, decodes ``--long-tokens``
tokens and leaves. Every scheduler step is timed: a running stream waits one step per
token, so a step's time is the gap it sees. Prints the running streams' steps before the
long prompt, while it prefills, and while it decodes among them (the join included),
and checks that both give the running streams and the long prompt the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Sequence

TIER_GAP_S = 0.4  # cpu-small's engine.max_decode_gap_ms


def _run(model: Any, tokenizer: Any, lanes: bool, running: list[list[int]], long: list[int],
         long_tokens: int, banned: dict[int, float]) -> dict[str, Any]:
    from omlx_core.engine import GenerationRequest, SamplingParams
    from omlx_core.scheduling.batch_state import new_sequence
    from omlx_core.scheduling.prefix_cache import PrefixCache
    from omlx_core.scheduling.scheduler import Scheduler

    scheduler = Scheduler(model=model, tokenizer=tokenizer, model_id="default", model_config={},
                          vocab_size=model.args.vocab_size, max_batch_size=16,
                          prefill_step_size=256,
                          prefix_cache=PrefixCache(block_size=64, budget_bytes=1 << 30),
                          wake=lambda: None, max_decode_gap_s=TIER_GAP_S, decode_lanes=lanes)
    greedy = SamplingParams(temperature=0.0, max_tokens=100_000, logit_bias=banned)
    rows = [new_sequence(GenerationRequest(f"running-{i}", prompt, greedy))
            for i, prompt in enumerate(running)]
    for row in rows:
        scheduler.enqueue(row)
    while len(scheduler.state.decoding) < len(rows) or scheduler.state.prefilling:
        scheduler.step()
    phases: dict[str, list[float]] = {"before": [], "prefill": [], "decode": []}
    for _ in range(12):
        started = time.perf_counter()
        scheduler.step()
        phases["before"].append(time.perf_counter() - started)
    late = new_sequence(GenerationRequest(
        "long", long, SamplingParams(temperature=0.0, max_tokens=long_tokens, logit_bias=banned)))
    scheduler.enqueue(late)
    lanes_seen = 1
    while late.phase.value != "done":
        phase = "prefill" if late.phase.value != "decoding" else "decode"
        started = time.perf_counter()
        scheduler.step()
        phases[phase].append(time.perf_counter() - started)
        lanes_seen = max(lanes_seen, len(scheduler.decode.lanes))
    tokens = {s.request_id: list(s.generated) for s in rows + [late]}
    scheduler.shutdown()
    return {"phases": phases, "tokens": tokens, "lanes": lanes_seen}


def _stats(values: Sequence[float]) -> str:
    """``p50 / p95 / max`` in milliseconds, and how many steps."""
    if not values:
        return "-"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return (f"{statistics.median(values) * 1000:.0f} / {p95 * 1000:.0f} / "
            f"{max(values) * 1000:.0f} ({len(values)} steps)")


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import blas_in_use, ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_lanes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=8, help="streams decoding first")
    parser.add_argument("--context", type=int, default=300, help="their prompts' tokens")
    parser.add_argument("--long", type=int, default=5000, help="the arriving prompt's tokens")
    parser.add_argument("--long-tokens", type=int, default=16,
                        help="tokens the long prompt decodes among the streams")
    args = parser.parse_args(argv)

    from omlx_core.bench.prompts import text_of_tokens
    from omlx_core.mlx_thread import mlx_thread
    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.loader import load_model

    model_dir = ensure_default_model(progress=True)
    model, tokenizer = mlx_thread().run(lambda: load_model(model_dir))
    running = [tokenizer.encode(text_of_tokens(model_dir, args.context, seed=40 + i,
                                               heading=f"Notes {i}:") + "\nGo on:")
               for i in range(args.running)]
    long = tokenizer.encode(text_of_tokens(model_dir, args.long, seed=11,
                                           heading="Here is the maintenance log:") + "\nSum up:")
    banned = {t: -100.0 for t in tokenizer.eos_token_ids}
    print(f"default model, CPU backend, BLAS: {blas_in_use()}; {args.running} streams of "
          f"~{args.context}-token prompts, then a {len(long)}-token prompt decoding "
          f"{args.long_tokens} tokens among them; decode-gap budget {TIER_GAP_S * 1000:.0f} ms")
    results = {}
    for lanes in (False, True):
        results[lanes] = mlx_thread().run(
            lambda: _run(model, tokenizer, lanes, running, long, args.long_tokens, banned))
        print(f"  {'lanes' if lanes else 'one padded batch'}: done", flush=True)
    one, split = results[False]["tokens"], results[True]["tokens"]
    # A row's tokens up to the shorter run's end (the streams run on until the long
    # prompt ends, which takes each variant a different number of steps).
    differ = {}
    for request_id, tokens in one.items():
        other = split[request_id]
        common = min(len(tokens), len(other))
        first = next((i for i in range(common) if tokens[i] != other[i]), None)
        if first is not None:
            differ[request_id] = first
    same = not differ
    print("\n| decode batch | lanes | step p50 / p95 / max (ms): before it arrives "
          "| while it prefills | while it decodes among them (join included) |")
    print("|---|---:|---|---|---|")
    for lanes, name in ((False, "one padded batch (mlx-lm's)"), (True, "lanes (omlx-core)")):
        phases = results[lanes]["phases"]
        print(f"| {name} | {results[lanes]['lanes']} | {_stats(phases['before'])} | "
              f"{_stats(phases['prefill'])} | {_stats(phases['decode'])} |")
    print(f"\nsame tokens for every stream and the long prompt: "
          f"{'yes' if same else 'NO, first differing token by request: ' + repr(differ)}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
