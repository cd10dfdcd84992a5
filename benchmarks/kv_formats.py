"""Perplexity of KV storage formats on the default model, built or not, on several texts.

``benchmarks.kv_quantized`` measures the formats ``--kv-bits`` serves. This one compares
formats before anyone builds them: each attention layer's cache is mlx-lm's float
``KVCache`` storing what a format would give back (every key and value row quantized
and dequantized as it is written, so attention reads exactly what the format keeps),
and the text is prefilled in 256-token chunks as the engine prefills it. A format
simulated here and the same format served agree to within 4-bit's own noise: rounding
differences of 1e-6 upstream move some values across a 4-bit level, and those flips add
up over 30 layers (``4-bit rotated``: +5.97 % here, +5.62 % served, on the fixed text;
8-bit within 0.07 points; unrotated 4-bit to the digit).

Formats (4 or 8 bits, mlx's affine quantization: a scale and a bias per group):

- ``8-bit``, ``4-bit``: groups of 64 along each token's row (mlx-lm's ``QuantizedKVCache``).
- ``... rotated``: the rows multiplied by the Hadamard rotation first (what ``--kv-bits 8``
  stores, ``omlx_core/models/kv_rotation.py``).
- ``4-bit, keys per channel (N tokens), values rotated``: keys quantized along the token
  axis instead, each channel in groups of N consecutive tokens (KIVI's layout for keys,
  arXiv:2402.02750); a chunk's last tokens short of a group stay in float, as KIVI's
  residual of the newest tokens does. With 64 tokens it is what ``--kv-bits 4`` stores
  (``omlx_core/scheduling/kv_tiles.py``, where the residual is quantized once it fills a
  tile).
- ``keys 8-bit, values 4-bit rotated``: mixed widths, for scale.

    python -m benchmarks.kv_formats [--text FILE ...] [--formats NAME,...] [--out FILE]

Perplexity is deterministic: one run per format and text. Prints a table of each
format's perplexity change over float KV, a column per text.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
#: tokens of a text scored at most (the fixed text has 2,007)
MAX_TOKENS = 2300
CHUNK = 256


def _row_format(bits: int, group: int = 64, rotated: bool = False) -> Callable[[Any], Any]:
    import mlx.core as mx

    from omlx_core.models.kv_rotation import kv_rotation

    def stored(rows: Any) -> Any:
        rotation = kv_rotation(rows.shape[-1], rows.dtype) if rotated else None
        if rotation is not None:
            rows = rows @ rotation
        rows = mx.dequantize(*mx.quantize(rows, group_size=group, bits=bits), group_size=group, bits=bits)
        return rows @ rotation if rotation is not None else rows

    return stored


def _channel_format(bits: int, tokens: int) -> Callable[[Any], Any]:
    import mlx.core as mx

    def stored(rows: Any) -> Any:
        full = rows.shape[2] // tokens * tokens
        if not full:
            return rows
        channels = rows[:, :, :full].swapaxes(-1, -2)
        back = mx.dequantize(*mx.quantize(channels, group_size=tokens, bits=bits),
                             group_size=tokens, bits=bits).swapaxes(-1, -2)
        return mx.concatenate([back, rows[:, :, full:]], axis=2)

    return stored


def formats() -> dict[str, tuple[Callable[[Any], Any] | None, Callable[[Any], Any] | None]]:
    """Name -> (what a key row is stored as, what a value row is stored as)."""
    return {
        "float": (None, None),
        "8-bit": (_row_format(8), _row_format(8)),
        "8-bit rotated": (_row_format(8, rotated=True), _row_format(8, rotated=True)),
        "4-bit": (_row_format(4), _row_format(4)),
        "4-bit rotated": (_row_format(4, rotated=True), _row_format(4, rotated=True)),
        "4-bit rotated, groups of 32": (_row_format(4, 32, True), _row_format(4, 32, True)),
        "4-bit, keys per channel (32 tokens), values rotated": (_channel_format(4, 32), _row_format(4, rotated=True)),
        "4-bit, keys per channel (64 tokens), values rotated": (_channel_format(4, 64), _row_format(4, rotated=True)),
        "keys 8-bit, values 4-bit rotated": (_row_format(8), _row_format(4, rotated=True)),
    }


def perplexity_over(model: Any, tokens: Sequence[int], cache: list[Any]) -> float:
    """The perplexity of ``tokens`` under ``model``, prefilled in :data:`CHUNK`-token chunks
    into ``cache`` (one layer cache per model layer, as the engine prefills): every
    position's next-token log-likelihood."""
    import mlx.core as mx

    total = 0.0
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start:start + CHUNK]
        targets = tokens[start + 1:start + 1 + len(chunk)]
        logits = model(mx.array(chunk)[None], cache=cache)[0, :len(targets)].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        total -= float(mx.sum(mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)).item())
    return math.exp(total / (len(tokens) - 1))


def perplexity(model: Any, tokens: Sequence[int], key_format: Any, value_format: Any) -> float:
    """:func:`perplexity_over` a float cache that stores rows as the formats give them back."""
    from mlx_lm.models.cache import KVCache

    class Stored(KVCache):
        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            return super().update_and_fetch(key_format(keys) if key_format else keys,
                                            value_format(values) if value_format else values)

    return perplexity_over(model, tokens, [Stored() for _ in model.layers])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_formats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, action="append",
                        help="a text to score (repeatable; default benchmarks/data/perplexity.txt); "
                             f"its first {MAX_TOKENS} tokens")
    parser.add_argument("--formats", help="comma-separated names of the formats to run (default all)")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    texts = args.text or [DEFAULT_TEXT]
    for text in texts:
        if not text.is_file():
            parser.error(f"--text {text}: no such file")
    table = formats()
    names = [n.strip() for n in args.formats.split(",")] if args.formats else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"--formats: unknown {unknown}; known: {', '.join(table)}")
    if "float" not in names:
        names.insert(0, "float")

    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()  # mlx's bundled reference BLAS is ~80x slower
    from omlx_core.mlx_thread import mlx_thread
    from omlx_core.models.default import ensure_default_model
    from omlx_core.scheduling import load_model

    model_dir = ensure_default_model()

    def run() -> dict[str, dict[str, float]]:
        model, tokenizer = load_model(model_dir)
        results: dict[str, dict[str, float]] = {}
        for text in texts:
            tokens = tokenizer.encode(text.read_text(encoding="utf-8"))[:MAX_TOKENS]
            for name in names:
                print(f"[{datetime.datetime.now():%H:%M:%S}] {text.name}: {name}", file=sys.stderr, flush=True)
                results.setdefault(name, {})[text.name] = perplexity(model, tokens, *table[name])
        return results

    results = mlx_thread().run(run)
    columns = [text.name for text in texts]
    lines = ["# KV storage formats: perplexity change over float KV", "",
             f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs; model `{model_dir.name}`; each text's first {MAX_TOKENS} tokens "
             f"at most, prefilled in {CHUNK}-token chunks; float perplexity: "
             + ", ".join(f"{c} {results['float'][c]:.4f}" for c in columns), "",
             "| format | " + " | ".join(f"`{c}`" for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name in names:
        if name == "float":
            continue
        cells = [f"{100 * (results[name][c] / results['float'][c] - 1):+.2f} %" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
