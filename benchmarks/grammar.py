"""Grammar-constrained decoding costs on the default model (SmolLM2-135M, 49k vocabulary):
compile time cold and cached, the per-token cost of filling and applying a mask, greedy
decode speed with and without a constraint in a bare loop, and aggregate decode tok/s
at 1 and 16 streams through the serving pipeline and the batched engine (the server's
own path), unconstrained against every stream constrained by a JSON schema.

    python -m benchmarks.grammar [--decode-tokens 48] [--out docs/grammar-bench.md]

Run it on a quiet machine; it takes about a minute after the default model is converted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from omlx_core.bench import publish_report

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags"],
}
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": SCHEMA}} for i in range(4)]
SAMPLE = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
                     "address": {"city": "London"}})


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def run(decode_tokens: int) -> str:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from omlx_core.grammar import GrammarCompilerCache, GrammarConstraint, GrammarSpec, special_tokens
    from omlx_core.grammar.tool_call_formats import detect_tool_call_format
    from omlx_core.grammar.toolcalls import tool_call_grammar
    from omlx_core.models.default import ensure_default_model

    model_dir = ensure_default_model(progress=True)
    model, tokenizer = load(str(model_dir))
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rows: list[tuple[str, str]] = []

    info_seconds, compiler = _timed(lambda: GrammarCompilerCache(tokenizer, vocab_size=vocab_size))
    rows.append(("tokenizer info + compiler", _ms(info_seconds)))
    fmt = detect_tool_call_format(getattr(tokenizer, "chat_template", None))
    specs = {
        "any JSON": GrammarSpec.any_json(),
        "JSON schema (5 properties, nested)": GrammarSpec.json_schema(SCHEMA),
        "regex (ISO date)": GrammarSpec.regex(r"\d{4}-\d{2}-\d{2}"),
        "EBNF (yes/no)": GrammarSpec.ebnf('root ::= "yes" | "no"'),
        f"tool calls ({fmt.name}, 4 functions, auto)": tool_call_grammar(
            fmt, TOOLS, "auto", special_tokens=special_tokens(tokenizer)),
    }
    for label, spec in specs.items():
        cold = compiler.compile(spec)
        cached_seconds, cached = _timed(lambda: compiler.compile(spec))
        assert cached.cached
        rows.append((f"compile {label}: cold / cached", f"{_ms(cold.compile_seconds)} / {_ms(cached_seconds)}"))

    # Mask cost along a real JSON output: fill (xgrammar, CPU) and apply (MLX), per token.
    compiled = compiler.compile(specs["JSON schema (5 properties, nested)"])
    constraint = GrammarConstraint(compiled)
    logits = mx.zeros((1, vocab_size))
    fills, applies = [], []
    for token in tokenizer.encode(SAMPLE):
        fill_seconds, bitmask = _timed(constraint.fill_bitmask)
        if bitmask is not None:
            from omlx_core.grammar import apply_token_bitmask

            apply_seconds, masked = _timed(lambda: mx.eval(apply_token_bitmask(logits, bitmask)))
            applies.append(apply_seconds)
        fills.append(fill_seconds)
        if not constraint.accept(token):
            raise RuntimeError(f"the sample output does not fit the schema at token {token}")
    rows.append(("mask fill per token (median, xgrammar)", _ms(statistics.median(fills))))
    rows.append(("mask apply per token (median, MLX)", _ms(statistics.median(applies))))

    def decode(processor: Callable | None) -> float:
        prompt = tokenizer.encode("Describe a person as JSON:")
        cache = make_prompt_cache(model)
        step = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
        context = list(prompt)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            if processor is not None:
                step = processor(mx.array(context), step)
            token = int(mx.argmax(step, axis=-1).item())
            context.append(token)
            step = model(mx.array([[token]]), cache=cache)[:, -1, :]
        mx.eval(step)
        return decode_tokens / (time.perf_counter() - started)

    # A schema that lets the output run as long as the unconstrained one.
    endless = compiler.compile(GrammarSpec.json_schema({"type": "array", "items": {"type": "string"}}))
    decode(None)  # warm-up: the first run pays for allocations the others reuse
    frees, constraineds = [], []
    for _ in range(2):  # alternated, so drifting machine load hits both alike
        frees.append(decode(None))
        constraineds.append(decode(GrammarConstraint(endless).processor()))
    free, constrained = statistics.median(frees), statistics.median(constraineds)
    rows.append((f"greedy decode, {decode_tokens} tokens (median of 2): unconstrained", f"{free:.1f} tok/s"))
    rows.append((f"greedy decode, {decode_tokens} tokens (median of 2): constrained", f"{constrained:.1f} tok/s "
                 f"({constrained / free:.2f}x)"))

    del model
    rows += serving_rows(decode_tokens)
    lines = ["# Grammar-constrained decoding (SmolLM2-135M float32, vocabulary %d)" % vocab_size, "",
             "| measure | value |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]]
    compiler.close()
    return "\n".join(lines) + "\n"


def serving_rows(tokens: int) -> list[tuple[str, str]]:
    """Aggregate decode tok/s through the serving pipeline, 1 and 16 streams, free and
    constrained; every stream runs to ``tokens`` (end-of-sequence banned when free; a
    schema that cannot be complete sooner when constrained)."""
    import threading

    from omlx_core.bench.client import BANNED_BIAS, special_token_ids
    from omlx_core.bootstrap import load_setup, start_engines, stop_engines
    from omlx_core.engine import SamplingParams
    from omlx_core.serving import Job, ServingPipeline

    context = start_engines(load_setup(None), progress=True)
    pipeline = ServingPipeline(context)
    model_id, engine = next(iter(context.engines.items()))
    banned = {t: BANNED_BIAS for t in special_token_ids(Path(engine.model.path))}
    from omlx_core.grammar import GrammarSpec

    endless = GrammarSpec.json_schema({"type": "array", "minItems": 10_000,
                                       "items": {"type": "integer", "minimum": 0, "maximum": 9}})
    free = SamplingParams(temperature=0.0, max_tokens=tokens, logit_bias=banned)
    constrained = SamplingParams(temperature=0.0, max_tokens=tokens, grammar=endless)

    def rate(streams: int, sampling: SamplingParams, round_index: int) -> float:
        counts = [0] * streams

        def one(i: int) -> None:
            generation = pipeline.start(Job(model_id, sampling, messages=[
                {"role": "user", "content": f"List {round_index}.{i}: numbers, as JSON."}]))
            for _delta in generation.deltas():
                pass
            generation.close()
            counts[i] = generation.completion_tokens

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.perf_counter() - started)

    rows: list[tuple[str, str]] = []
    try:
        rate(2, constrained, -1)  # warm-up: kernels, the grammar compiled once
        for streams in (1, 16):
            frees, constraineds = [], []
            for round_index in range(2):  # alternated against drifting load
                frees.append(rate(streams, free, 2 * round_index))
                constraineds.append(rate(streams, constrained, 2 * round_index + 1))
            f, c = statistics.median(frees), statistics.median(constraineds)
            rows.append((f"serving pipeline, {streams} stream(s) x {tokens} tokens: free / "
                         f"constrained (median of 2)", f"{f:.1f} / {c:.1f} tok/s ({c / f:.2f}x)"))
    finally:
        pipeline.close()
        stop_engines(context)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-tokens", type=int, default=48, help="tokens per decode run (default 48)")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args(argv)
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    publish_report(run(args.decode_tokens), args.out)


if __name__ == "__main__":
    main()
