"""Decode steps of the default model with the CPU kernels and without, paired.

    python -m benchmarks.cpu_kernels [--rounds 5] [--steps 8]
    python -m benchmarks.cpu_kernels --alone   # the kernels alone only, no model
    python -m benchmarks.cpu_kernels --against REV   # this checkout's kernels vs REV's

Loads the default model as the server does (its attention and SwiGLU routes installed),
fills a batch cache of ``rows`` sequences of ``context`` tokens, then decodes ``steps``
greedy tokens the way mlx-lm's ``BatchGenerator`` does (the next step's graph built and
queued while the host reads this step's tokens) and rolls the cache back; alternately
with the CPU kernels (:mod:`omlx_core.models.cpu_kernels`: the softmax and SwiGLU of a
decode step vectorized, in the graph) and with mlx's own ops (what ``mlx_lm.server``
runs). It prints the median step time of each and the median of the per-round ratios,
checks that both give the same greedy tokens, and times the kernels alone against mlx's
ops at a 16-row step's sizes (the softmax, the SwiGLU, and one step's decode attention
over 30 layers' own keys and values). The linear layers stay on mlx's matmul on both sides
(``OMLX_PACKED_LINEAR=0``; ``python -m benchmarks.packed_linear`` measures the packed ones).

``--against REV`` pairs this checkout's kernels with those of a git revision instead
(its ``cpu_kernels.cpp`` built beside them), both under the model as the server runs it
(packed linear layers): decode steps at 1 and 16 rows, same greedy tokens checked, and
one step's decode attention over 30 layers' own keys and values, each alternating which
goes first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Sequence

SHAPES = ((1, 400), (8, 400), (16, 400), (8, 1000), (16, 1000))
#: decode steps ``--against`` pairs: the bench's streams (128 tokens) and long contexts
AGAINST_SHAPES = ((1, 128), (16, 128), (16, 1000))


def decode_steps(model, cache, first, steps: int) -> tuple[float, list[list[int]]]:
    """Seconds per step and the tokens of ``steps`` pipelined greedy steps; the cache is
    rolled back after."""
    import mlx.core as mx

    tokens, pending = [], None
    started = time.perf_counter()
    step = first
    for _ in range(steps):
        logits = model(step, cache=cache)
        step = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.async_eval(step)
        if pending is not None:
            tokens.append(pending.tolist())
        pending = step
    tokens.append(pending.tolist())
    elapsed = (time.perf_counter() - started) / steps
    for layer in cache:
        layer.trim(steps)
    return elapsed, tokens


def _kernel_alone(rounds: int) -> list[tuple[str, float, float]]:
    import mlx.core as mx
    import mlx.nn as nn

    from omlx_core.models import cpu_kernels

    kernels = cpu_kernels.kernels()
    scores = mx.random.normal((16, 3, 3, 400)) * 4  # 16 rows x 9 heads over 400 keys
    gate, up = mx.random.normal((16, 1, 1536)) * 4, mx.random.normal((16, 1, 1536))
    mx.eval(scores, gate, up)

    def median_ms(run) -> float:
        mx.eval(run())
        times = []
        for _ in range(max(rounds, 5) * 20):
            started = time.perf_counter()
            mx.eval(run())
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    rows = [("softmax, 16 x 9 x 400 scores", median_ms(lambda: mx.softmax(scores, axis=-1, precise=True)),
             median_ms(lambda: kernels.softmax(scores))),
            ("SwiGLU, 16 x 1536", median_ms(lambda: nn.silu(gate) * up),
             median_ms(lambda: kernels.swiglu(gate, up)))]
    for keys in (170, 1000):
        q, layers = _step_attention_inputs(keys)
        rows.append((f"decode attention, 30 layers x 16 rows x 9 heads (3 KV) x {keys} keys",
                     median_ms(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
                                        for k, v in layers]),
                     median_ms(lambda: [kernels.decode_attention(q, k, v, None, 0.125)
                                        for k, v in layers])))
    return rows


def _step_attention_inputs(keys: int):
    """One 16-row step's attention inputs: 30 layers, each its own keys and values (a
    step reads them all from memory, as the model's cache holds them: 256-row slabs,
    sliced)."""
    import mlx.core as mx

    q = mx.random.normal((16, 1, 9, 64)).transpose(0, 2, 1, 3)
    layers = [[mx.random.normal((16, 3, keys + 256, 64))[:, :, :keys] for _ in range(2)]
              for _ in range(30)]
    mx.eval(q, layers)
    return q, layers


def in_turn(variants: dict, round_: int) -> list:
    """The variants in this round's order: each goes first every other round (the one run
    second in every round measured up to 8 % slower at a 2,048-token prefill)."""
    return list(variants.items())[::-1 if round_ % 2 else 1]


def against(revision: str, rounds: int, steps: int) -> int:
    """This checkout's kernels paired with ``revision``'s (see the module)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from omlx_core.models import cpu_kernels
    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.loader import load_model

    ours = cpu_kernels.kernels()
    if ours is None:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}",
              file=sys.stderr)
        return 1
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "show", f"{revision}:omlx_core/models/cpu_kernels.cpp"],
                           cwd=root, capture_output=True, text=True)
    if shown.returncode != 0:
        print(f"no kernels at {revision!r}: {shown.stderr.strip()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "cpu_kernels.cpp"
        source.write_text(shown.stdout)
        print(f"building {revision}'s kernels (~15 s)", flush=True)
        variants = {revision: cpu_kernels.build_source(source, Path(scratch) / "build"),
                    "this checkout": ours}
        model, _ = load_model(ensure_default_model(progress=True))
        print(f"default model as the server runs it; {rounds} paired rounds of {steps} "
              "pipelined greedy decode steps per shape, which goes first alternating")
        table = []
        for rows, context in AGAINST_SHAPES:
            cache = [BatchKVCache([0] * rows) for _ in model.layers]
            prompt = mx.random.randint(0, 20000, (rows, context),
                                       key=mx.random.key(rows + context))
            mx.eval(model(prompt, cache=cache))
            first = mx.random.randint(0, 20000, (rows, 1), key=mx.random.key(7))
            timings = {name: [] for name in variants}
            outputs = {}
            for round_ in range(rounds + 1):  # the first round warms both up
                for name, module in in_turn(variants, round_):
                    with cpu_kernels.using(module):
                        elapsed, tokens = decode_steps(model, cache, first, steps)
                    outputs.setdefault(name, tokens)
                    if round_:
                        timings[name].append(elapsed * 1000)
            table.append((f"decode step, {rows} x {context}", timings,
                          "yes" if len({str(t) for t in outputs.values()}) == 1 else "NO"))
            print(f"  {rows} rows x {context}: done", flush=True)
        for keys in (170, 1000):
            q, layers = _step_attention_inputs(keys)
            timings = {name: [] for name in variants}
            for round_ in range(rounds * 4 + 1):
                for name, module in in_turn(variants, round_):
                    started = time.perf_counter()
                    mx.eval([module.decode_attention(q, k, v, None, 0.125) for k, v in layers])
                    if round_:
                        timings[name].append((time.perf_counter() - started) * 1000)
            table.append((f"decode attention alone, 30 layers x 16 rows x {keys} keys",
                          timings, "-"))
    old, new = variants
    print(f"\n| ms (median) | {old} | {new} | {old} / {new} (median of pairs) | range | "
          "same greedy tokens |")
    print("|---|---:|---:|---:|---|---|")
    for name, timings, same in table:
        ratios = [a / b for a, b in zip(timings[old], timings[new])]
        print(f"| {name} | {statistics.median(timings[old]):.1f} | "
              f"{statistics.median(timings[new]):.1f} | {statistics.median(ratios):.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x | {same} |")
    return 0 if all(same != "NO" for _, _, same in table) else 1


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import blas_in_use, ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds per shape")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--alone", action="store_true",
                        help="only the kernels alone against mlx's ops (no model)")
    parser.add_argument("--against", metavar="REV",
                        help="pair this checkout's kernels with a git revision's")
    args = parser.parse_args(argv)
    if args.against:
        return against(args.against, args.rounds, args.steps)

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from omlx_core.models import cpu_kernels
    from omlx_core.models.default import ensure_default_model
    from omlx_core.models.loader import load_model
    from omlx_core.models.packed_linear import OFF_ENV

    if args.alone:
        _print_alone(args.rounds)
        return 0
    # Linear layers through mlx's matmul on both sides: the A/B toggles the kernels module,
    # which the packed layers need (benchmarks/packed_linear.py measures those).
    os.environ[OFF_ENV] = "0"
    model, _ = load_model(ensure_default_model(progress=True))
    kernels = cpu_kernels.kernels()
    if kernels is None:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}",
              file=sys.stderr)
        return 1
    print(f"default model, float32, CPU backend, BLAS: {blas_in_use()}")
    print(f"{args.rounds} paired rounds of {args.steps} pipelined greedy decode steps per shape")
    rows_out = []
    for rows, context in SHAPES:
        cache = [BatchKVCache([0] * rows) for _ in model.layers]
        prompt = mx.random.randint(0, 20000, (rows, context), key=mx.random.key(rows + context))
        mx.eval(model(prompt, cache=cache))
        mx.eval([layer.state for layer in cache])
        first = mx.random.randint(0, 20000, (rows, 1), key=mx.random.key(7))
        timings = {"mlx": [], "kernels": []}
        outputs = {}
        for round_ in range(args.rounds + 1):  # the first round warms both up
            for name, module in (("mlx", None), ("kernels", kernels)):
                with cpu_kernels.using(module):
                    elapsed, tokens = decode_steps(model, cache, first, args.steps)
                outputs.setdefault(name, tokens)
                if round_:
                    timings[name].append(elapsed)
        ratios = [a / b for a, b in zip(timings["mlx"], timings["kernels"])]
        same = outputs["mlx"] == outputs["kernels"]
        rows_out.append((rows, context, statistics.median(timings["mlx"]) * 1000,
                         statistics.median(timings["kernels"]) * 1000, statistics.median(ratios),
                         min(ratios), max(ratios), same))
        print(f"  {rows} rows x {context}: done", flush=True)

    print("\n| rows x context | mlx's ops, ms/step | CPU kernels, ms/step | mlx / kernels "
          "(median of rounds) | range | same greedy tokens |")
    print("|---|---:|---:|---:|---|---|")
    for rows, context, base, fast, ratio, low, high, same in rows_out:
        print(f"| {rows} x {context} | {base:.1f} | {fast:.1f} | {ratio:.2f}x | "
              f"{low:.2f}-{high:.2f}x | {'yes' if same else 'NO'} |")
    _print_alone(args.rounds)
    return 0 if all(row[-1] for row in rows_out) else 1


def _print_alone(rounds: int) -> None:
    print("\n| alone (median) | mlx's ops, ms | CPU kernel, ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, base, fast in _kernel_alone(rounds):
        print(f"| {name} | {base:.3f} | {fast:.3f} | {base / fast:.1f}x |")


if __name__ == "__main__":
    sys.exit(main())
