"""Benchmark of the paged SSD cache: long-prompt TTFT across a restart, and write throughput.

    python -m benchmarks.ssd_cache [--model DIR] [--prompt-tokens 4096]
        [--quick] [--out docs/ssd-cache-bench.md]

**TTFT.** ``omlx-core serve``, started as ``./setup.sh serve`` starts it (the tier it
picks, the SSD cache on by default; only ``OMLX_CACHE_DIR`` is a new directory, so the
cache starts empty), answers one streaming chat request with a ``--prompt-tokens``
prompt: cold, again (an in-memory prefix-cache hit), once more after the server was
stopped and started again (its memory is empty: every reused block is read back from
disk), and, after another restart, the same passage with a different question (the
block the question cuts into is reused in part, to the token). The peer is
``mlx_lm.server`` on the same model, which keeps its prompt cache in memory only: after
its restart it pays the cold prefill again.

**Write throughput.** A :class:`~.store.PagedSSDStore` in this process receives a
sustained burst of blocks shaped like the model's (all layers, ``plugin.batched.block_size``
tokens) as fast as the caller can produce them, with a small and a default write queue:
blocks saved and persisted per second, MB/s, blocks dropped because the writer could not
keep up, and the caller's (the MLX thread's) median cost per save.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from omlx_core.plugins.ssd_cache.store import DEFAULT_QUEUE_BYTES

DEFAULT_OUT = Path("docs/ssd-cache-bench.md")


@dataclass
class TTFTRow:
    server: str
    cold: float
    memory_hit: float
    restart_hit: float
    restart_cached: int
    prompt_tokens: int
    new_question: float
    new_question_cached: int
    new_question_tokens: int


def _ttft(port: int, model_id: str, text: str) -> tuple[float, int, int]:
    from omlx_core.bench.client import chat_body, stream_chat

    body = chat_body(model_id, [{"role": "user", "content": text}], max_tokens=2)
    record = stream_chat("127.0.0.1", port, body)
    return record.ttft, record.prompt_tokens or 0, record.cached_tokens or 0


def measure_ttft(spec_of, name: str, model_id: str, text: str, other_question: str) -> TTFTRow:
    from omlx_core.bench.servers import ServerProcess, free_port

    port = free_port()
    with ServerProcess(spec_of(port), port, ready_timeout=600):
        cold, prompt_tokens, _ = _ttft(port, model_id, text)
        print(f"  {name}: cold TTFT {cold:.2f} s ({prompt_tokens} prompt tokens)", flush=True)
        memory_hit, _, _ = _ttft(port, model_id, text)
        print(f"  {name}: in-memory hit TTFT {memory_hit:.3f} s", flush=True)
    port = free_port()
    with ServerProcess(spec_of(port), port, ready_timeout=600):
        restart_hit, _, cached = _ttft(port, model_id, text)
        print(f"  {name}: after restart TTFT {restart_hit:.3f} s ({cached} cached tokens)", flush=True)
    port = free_port()
    with ServerProcess(spec_of(port), port, ready_timeout=600):
        new_question, question_tokens, question_cached = _ttft(port, model_id, other_question)
        print(f"  {name}: after restart, new question TTFT {new_question:.3f} s "
              f"({question_cached} of {question_tokens} tokens cached)", flush=True)
    return TTFTRow(name, cold, memory_hit, restart_hit, cached, prompt_tokens, new_question,
                   question_cached, question_tokens)


@dataclass
class WriteRow:
    queue_size: int
    offered: int
    saves: int
    persisted: int
    drops: int
    declined: int
    seconds: float
    megabytes: float
    put_ms_p50: float
    put_ms_max: float


def _weights_dtype(model_dir: Path):
    """The dtype of the model's weights (its KV cache has the same), from a safetensors header."""
    import mlx.core as mx
    from safetensors import safe_open

    with safe_open(str(next(model_dir.glob("*.safetensors"))), framework="numpy") as handle:
        stored = handle.get_slice(next(iter(handle.keys()))).get_dtype()
    return {"F16": mx.float16, "BF16": mx.bfloat16}.get(stored, mx.float32)


def measure_writes(model_dir: Path, blocks: int, queue_size: int, block_size: int) -> WriteRow:
    """A sustained save burst of model-shaped blocks into a fresh store."""
    import mlx.core as mx

    from omlx_core.kvblocks import CachedBlock
    from omlx_core.plugins.ssd_cache.store import PagedSSDStore

    config = json.loads((model_dir / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    dtype = _weights_dtype(model_dir)
    template = mx.random.normal((1, kv_heads, block_size, head_dim)).astype(dtype)
    with tempfile.TemporaryDirectory(prefix="omlx-ssd-bench-") as directory:
        store = PagedSSDStore(Path(directory), identity="bench", budget=None, queue_size=queue_size)
        put_ms = []
        started = time.perf_counter()
        for index in range(blocks):
            kv = tuple((template + index, template - index) for _ in range(layers))
            mx.eval([a for pair in kv for a in pair])
            block = CachedBlock(index.to_bytes(16, "big"), b"\0" * 16, index, block_size, kv, None,
                                True, sum(a.nbytes for pair in kv for a in pair))
            t0 = time.perf_counter()
            store.put(block)
            put_ms.append((time.perf_counter() - t0) * 1000)
        store.flush(600)
        seconds = time.perf_counter() - started
        stats = store.stats()
        megabytes = stats["bytes"] / 1e6
        store.close(cleanup=True)
    return WriteRow(queue_size, blocks, stats["saves"], stats["saves_persisted"], stats["drops"],
                    stats["declined"], seconds, megabytes, statistics.median(put_ms), max(put_ms))


def render(ttft: list[TTFTRow], writes: list[WriteRow], header: list[str]) -> str:
    lines = ["# Paged SSD cache benchmark", "", *header, "",
             "## Long-prompt TTFT: cold, in-memory hit, after a restart", "",
             "| server | prompt tokens | cold (s) | memory hit (s) | after restart (s) | "
             "cached after restart | after restart / cold | after restart, new question (s) | "
             "its tokens cached |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in ttft:
        lines.append(f"| {row.server} | {row.prompt_tokens} | {row.cold:.2f} | {row.memory_hit:.3f} | "
                     f"{row.restart_hit:.3f} | {row.restart_cached} | "
                     f"{row.restart_hit / row.cold:.1%} | {row.new_question:.3f} | "
                     f"{row.new_question_cached} of {row.new_question_tokens} |")
    if len(ttft) == 2:
        ours, peer = ttft
        met = "met" if ours.restart_hit <= 0.05 * ours.cold else "MISSED"
        lines += ["", f"After a restart omlx-core answers in {ours.restart_hit:.2f} s, "
                      f"{peer.server} in {peer.restart_hit:.2f} s: "
                      f"**{ours.restart_hit / peer.restart_hit:.3f}×**; target ≤ 5 % of cold: "
                      f"{ours.restart_hit / ours.cold:.1%}, {met}. A new question after a restart: "
                      f"{ours.new_question:.2f} s vs {peer.new_question:.2f} s "
                      f"(**{ours.new_question / peer.new_question:.3f}×**)."]
    lines += ["", "## Write throughput under a sustained save burst", "",
              "Host copies waiting for the writer are bounded at "
              f"{DEFAULT_QUEUE_BYTES >> 20} MiB (`plugin.ssd_cache.queue_bytes`, the default).", "",
              "| write queue | blocks offered | saves (passed the gate) | persisted | dropped | "
              "declined (quota) | seconds | MB persisted | MB/s | put() p50 ms | put() max ms |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in writes:
        lines.append(f"| {row.queue_size} | {row.offered} | {row.saves} | {row.persisted} | "
                     f"{row.drops} | {row.declined} | {row.seconds:.2f} | {row.megabytes:.0f} | "
                     f"{row.megabytes / row.seconds:.0f} | {row.put_ms_p50:.2f} | {row.put_ms_max:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from omlx_core.platform.blas import ensure_optimized_blas

    ensure_optimized_blas()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ssd_cache",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="mlx-lm model directory (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=400, help="blocks in the write burst")
    parser.add_argument("--quick", action="store_true",
                        help="1k-token prompt, omlx-core only, 60-block burst (a smoke run)")
    parser.add_argument("--out", type=Path, help=f"write the markdown table here (default {DEFAULT_OUT}; "
                                                 "none with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.blocks = 1024, 60

    from omlx_core.bench import publish_report
    from omlx_core.bench.prompts import text_of_tokens
    from omlx_core.bench.servers import ServerSpec, fresh_cache_root, mlx_lm_spec, omlx_spec
    from omlx_core.bench.serving import settings_for
    from omlx_core.config import load_config

    model_dir = args.model
    if model_dir is None:
        from omlx_core.models.default import ensure_default_model

        model_dir = ensure_default_model()
    model_dir = Path(model_dir).expanduser().resolve()
    passage = text_of_tokens(model_dir, args.prompt_tokens, seed=7, heading="Read this passage.")
    text = passage + "\n\nWhat is the passage about? Answer in one sentence."
    other_question = passage + "\n\nWhich word appears most often in it?"
    cache_root = fresh_cache_root()
    settings = settings_for(None, [])
    served_id = None if args.model else load_config(None)["server.models"][0]

    def omlx(port: int) -> ServerSpec:
        return omlx_spec(None if served_id else model_dir, port, settings, served_id, cache_root)

    print(f"TTFT of a {args.prompt_tokens}-token prompt, model {model_dir.name}", flush=True)
    rows = [measure_ttft(omlx, "omlx-core", served_id or model_dir.name, text, other_question)]
    if not args.quick:
        rows.append(measure_ttft(lambda port: mlx_lm_spec(model_dir, port, settings), "mlx_lm.server",
                                 "default_model", text, other_question))
    block_size = 64
    print(f"write burst: {args.blocks} blocks of {block_size} tokens", flush=True)
    writes = [measure_writes(model_dir, args.blocks, queue, block_size) for queue in (4, 64)]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    header = [f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
              f"{os.cpu_count()} CPUs, load average {load[0]:.2f}; model `{model_dir.name}`; "
              f"omlx-core started as `./setup.sh serve` starts it (tier `{settings.tier}`, picked "
              f"for this machine; no overrides; `OMLX_CACHE_DIR` a new directory so the SSD cache "
              f"starts empty); mlx_lm.server given the same batch ({settings.max_batch_size}) and "
              f"prefill step ({settings.prefill_step_size}) ({'quick run' if args.quick else 'full run'})",
              "- TTFT: streaming chat request sent to its first text chunk, max_tokens 2; each "
              "server is stopped and started again between the second and third request"]
    report = render(rows, writes, header)
    publish_report(report, args.out if args.out is not None else (None if args.quick else DEFAULT_OUT))
    import shutil

    shutil.rmtree(cache_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
