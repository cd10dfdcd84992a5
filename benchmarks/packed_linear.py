"""Decode steps and prefill of the default model with its linear layers packed, and with
mlx's matmul (the BLAS), paired in one process.

    python -m benchmarks.packed_linear [--rounds 5] [--steps 8]

Loads the default model twice as the server does: once with its float32 linear layers
and tied embedding packed (:mod:`omlx_core.models.packed_linear`, the default) and once
with ``OMLX_PACKED_LINEAR=0`` (what it was: every product through mlx's matmul and the
BLAS it is given, as ``mlx_lm.server`` runs). For each shape it fills a batch cache of
``rows`` sequences of ``context`` tokens in both, then alternates rounds of ``steps``
pipelined greedy decode steps between them (the cache rolled back after each; which
goes first alternates by round) and prints
the median step of each, the median of the per-round ratios and its range, and whether
the greedy tokens agree (the two round differently). Then a 2,048-token prefill in
512-token chunks, paired the same way, and the machine's bound: one matmul of the
model's size timed both ways, with each variant's 16-row step as a share of the faster.

    python -m benchmarks.packed_linear --siblings [--rounds 5] [--steps 8]

pairs the packed product's two ways instead: sibling layers (q/k/v, gate/up) packed as
one weight and multiplied in one call (the default), and each layer alone
(``OMLX_PACKED_SIBLINGS=0``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Sequence

from benchmarks.cpu_kernels import decode_steps, in_turn

SHAPES = ((1, 128), (8, 128), (16, 128), (16, 1000))
PREFILL_TOKENS, PREFILL_CHUNK = 2048, 512


def _load(env: dict[str, str]) -> Any:
    """The default model loaded with ``env`` set (and put back after)."""
    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.loader import load_model

    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return load_model(ensure_default_model(progress=True))[0]
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _prefill_seconds(model: Any, prompt: Any) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    started = time.perf_counter()
    for start in range(0, prompt.shape[1], PREFILL_CHUNK):
        mx.eval(model(prompt[:, start:start + PREFILL_CHUNK], cache=cache)[:, -1])
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import blas_in_use, ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.packed_linear",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds per shape")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--siblings", action="store_true",
                        help="pair siblings packed as one against each layer alone")
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from omlx_core.bench.bound import WAY_NAMES, model_weights, time_matmul
    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.packed_linear import OFF_ENV, SIBLINGS_ENV, PackedLinear, packed_bits

    bits = packed_bits()
    if bits == 0:
        print("the packed product does not run here (no CPU kernels, or a CPU without AVX2 "
              "and FMA)", file=sys.stderr)
        return 1
    if args.siblings:
        base, fast = "each layer alone", "siblings as one"
        models = {base: _load({OFF_ENV: "1", SIBLINGS_ENV: "0"}), fast: _load({OFF_ENV: "1"})}
    else:
        base, fast = "BLAS", "packed"
        models = {base: _load({OFF_ENV: "0"}), fast: _load({OFF_ENV: "1"})}
    assert any(isinstance(m, PackedLinear) for _, m in models[fast].named_modules())
    print(f"default model, float32, CPU backend, BLAS: {blas_in_use()}, packed product at "
          f"{bits} bits; {args.rounds} paired rounds of {args.steps} pipelined greedy decode "
          "steps per shape", flush=True)
    rows_out = []
    #: milliseconds of a step (base, fast) by rows, at the shortest context
    shares: dict[int, tuple[float, float]] = {}
    for rows, context in SHAPES:
        prompt = mx.random.randint(0, 20000, (rows, context), key=mx.random.key(rows + context))
        first = mx.random.randint(0, 20000, (rows, 1), key=mx.random.key(7))
        caches = {}
        for name, model in models.items():
            caches[name] = [BatchKVCache([0] * rows) for _ in model.layers]
            mx.eval(model(prompt, cache=caches[name]))
        timings: dict[str, list[float]] = {name: [] for name in models}
        outputs = {}
        for round_ in range(args.rounds + 1):  # the first round warms both up
            for name, model in in_turn(models, round_):
                elapsed, tokens = decode_steps(model, caches[name], first, args.steps)
                outputs.setdefault(name, tokens)
                if round_:
                    timings[name].append(elapsed)
        ratios = [a / b for a, b in zip(timings[base], timings[fast])]
        same = sum(a == b for step_a, step_b in zip(outputs[base], outputs[fast])
                   for a, b in zip(step_a, step_b))
        rows_out.append((f"{rows} x {context}", statistics.median(timings[base]) * 1000,
                         statistics.median(timings[fast]) * 1000, ratios,
                         f"{same}/{rows * args.steps}"))
        if context == SHAPES[0][1]:
            shares[rows] = (rows_out[-1][1], rows_out[-1][2])
        print(f"  {rows} rows x {context}: done", flush=True)

    prompt = mx.random.randint(0, 20000, (1, PREFILL_TOKENS), key=mx.random.key(11))
    prefill: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.rounds + 1):
        for name, model in in_turn(models, round_):
            seconds = _prefill_seconds(model, prompt)
            if round_:
                prefill[name].append(seconds)
    ratios = [a / b for a, b in zip(prefill[base], prefill[fast])]
    rows_out.append((f"prefill {PREFILL_TOKENS} tokens ({PREFILL_CHUNK}-token chunks)",
                     statistics.median(prefill[base]) * 1000,
                     statistics.median(prefill[fast]) * 1000, ratios, "-"))

    print(f"\n| step | {base}, ms | {fast}, ms | {base} / {fast} (median of rounds) | range | "
          "same greedy tokens |")
    print("|---|---:|---:|---:|---|---|")
    for shape, base_ms, fast_ms, ratios, same in rows_out:
        print(f"| {shape} | {base_ms:.1f} | {fast_ms:.1f} | {statistics.median(ratios):.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x | {same} |")

    ways = time_matmul(model_weights(ensure_default_model(progress=False)), [1, 16])
    print("\nThe bound: one matmul of the model's size (fastest of 15)")
    print("\n| rows | " + " | ".join(WAY_NAMES[w] + ", ms" for w in ways) + " |")
    print("|---:|" + "---:|" * len(ways))
    for count in (1, 16):
        print(f"| {count} | " + " | ".join(f"{ways[w][count] * 1000:.1f}" for w in ways) + " |")
    for count in (1, 16):
        fastest = min(times[count] for times in ways.values()) * 1000
        base_ms, fast_ms = shares[count]
        print(f"- {count} x {SHAPES[0][1]}: a step's share of the bound: {base} "
              f"{fastest / base_ms:.2f}, {fast} {fastest / fast_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
