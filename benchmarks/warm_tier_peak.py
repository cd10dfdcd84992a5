"""Peak resident memory under a ceiling with the SSD tier warm, and where it comes from
(issue 24, item 5; docs/reliability.md, "Peak RSS under the ceiling").

One round: ``omlx-core serve --memory-ceiling CEILING`` on the default model, started on
an SSD-cache directory an earlier server filled with the same prompts (the tier warm,
the memory cold), takes ten of ``benchmarks.ceiling``'s concurrent streaming chats (its
mix without the two 1.8k-token prompts). The first round's directory is filled by a
server of its own; later rounds reuse it.

Measured from outside: VmRSS sampled ``SAMPLE_HZ`` times a second and the kernel's
VmHWM (reset after a warm-up chat). Measured inside the server (it runs under
:func:`probe_main`, which wraps two methods to read memory around them and changes
nothing they do): the resident set, mlx's active memory and buffer cache, the prefix
cache's bytes, the SSD tier's queued host copies and the file-backed pages sampled at
``SAMPLE_HZ`` (the sample at the resident peak is kept, with what the MLX thread was
doing: admitting, prefilling, decoding), and for every admission step the resident set
and mlx's active and peak memory before and after it, with the bytes it read from the
SSD tier.

    python -m benchmarks.warm_tier_peak [--rounds 3] [--ceiling 0.9GiB] [--cache-root DIR]

A before/after comparison runs it with each checkout's sources in turn on one
``--cache-root`` (the tier stays warm), alternating, so both see the same load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from benchmarks.ceiling import PeakRss, prompts, reset_peak, status_fields
from omlx_core.bench import publish_report
from omlx_core.bench.client import chat_body, run_concurrently, special_token_ids, stream_chat
from omlx_core.bench.servers import ServerProcess, ServerSpec, fresh_cache_root, free_port
from omlx_core.settings import format_size, parse_size

MIB = 2**20
SAMPLE_HZ = 200
#: (kind, prompt tokens, max_tokens, count): benchmarks.ceiling's mix less its 1.8k prompts
MIX = (("short", 200, 64, 4), ("medium", 800, 64, 4), ("long answer", 200, 320, 2))


# -- inside the server ---------------------------------------------------------------------


def probe_main(out: Path, serve_argv: list[str]) -> int:
    """Run ``omlx-core`` with ``serve_argv`` under the probe; its readings go to ``out``
    (JSON, rewritten twice a second and at exit)."""
    import mlx.core as mx

    from omlx_core.cli import main as cli_main
    from omlx_core.memory.usage import resident_now
    from omlx_core.scheduling.prefill_runner import PrefillRunner
    from omlx_core.scheduling.scheduler import Scheduler
    from omlx_core.plugins.ssd_cache.store import PagedSSDStore

    lock = threading.Lock()
    state: dict[str, Any] = {"peak": None, "admits": [], "loaded_bytes": 0, "loads": 0,
                             "phase": "idle", "hard_bytes": None}
    schedulers: list[Scheduler] = []

    def held() -> int:
        return sum(s.prefix_cache.nbytes for s in schedulers)

    original_get = PagedSSDStore.get

    def get(self: PagedSSDStore, block_hash: bytes) -> Any:
        block = original_get(self, block_hash)
        if block is not None:
            with lock:
                state["loaded_bytes"] += block.nbytes
                state["loads"] += 1
        return block

    original_admit = Scheduler._admit

    def admit(self: Scheduler) -> None:
        if self not in schedulers:
            schedulers.append(self)
        limits = self.state.limits
        if limits is not None:
            state["hard_bytes"] = limits.hard_bytes
        waiting = len(self.state.waiting)
        loaded, rss, active = state["loaded_bytes"], resident_now() or 0, mx.get_active_memory()
        before_held = held()
        mx.reset_peak_memory()
        state["phase"] = "admitting"
        try:
            original_admit(self)
        finally:
            state["phase"] = "idle"
        admitted = waiting - len(self.state.waiting)
        if admitted:
            with lock:
                state["admits"].append({
                    "t": time.monotonic(), "admitted": admitted,
                    "loaded_bytes": state["loaded_bytes"] - loaded,
                    "rss_before": rss, "rss_after": resident_now() or 0,
                    "active_before": active, "active_after": mx.get_active_memory(),
                    "mlx_peak": mx.get_peak_memory(), "held_before": before_held,
                    "held_after": held()})

    def in_phase(name: str, original: Any) -> Any:
        def wrapped(self: Any) -> None:
            state["phase"] = name
            try:
                original(self)
            finally:
                state["phase"] = "idle"
        return wrapped

    PagedSSDStore.get = get  # type: ignore[method-assign]
    Scheduler._admit = admit  # type: ignore[method-assign]
    PrefillRunner.step = in_phase("prefill", PrefillRunner.step)  # type: ignore[method-assign]
    Scheduler._decode_step = in_phase("decode", Scheduler._decode_step)  # type: ignore[method-assign]
    stop = threading.Event()

    def dump() -> None:
        with lock:
            text = json.dumps({k: v for k, v in state.items() if k != "phase"})
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)

    def sample() -> None:
        last_dump = 0.0
        while not stop.is_set():
            rss = resident_now() or 0
            peak = state["peak"]
            if peak is None or rss > peak["rss"]:
                state["peak"] = {"rss": rss, "active": mx.get_active_memory(),
                                 "cache": mx.get_cache_memory(), "held": held(),
                                 "pending": sum(s.prefix_cache.reclaimable_bytes()
                                                for s in schedulers) - held(),
                                 "phase": state["phase"], "file": _rss_file(),
                                 "loaded_bytes": state["loaded_bytes"]}
            now = time.monotonic()
            if now - last_dump > 0.5:
                dump()
                last_dump = now
            stop.wait(1.0 / SAMPLE_HZ)

    threading.Thread(target=sample, daemon=True, name="warm-tier-probe").start()
    try:
        return cli_main(serve_argv)
    finally:
        stop.set()
        dump()


def _rss_file() -> int:
    """File-backed resident bytes of this process (RssFile + RssShmem)."""
    fields = status_fields("self")
    return fields.get("RssFile", 0) + fields.get("RssShmem", 0)


# -- the benchmark -----------------------------------------------------------------------


@dataclass
class Round:
    label: str
    completed: int = 0
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    peak_rss: int = 0
    hwm: int = 0
    probe: dict[str, Any] = field(default_factory=dict)
    load: tuple[float, float] = (0.0, 0.0)
    ssd_blocks_at_start: int = 0

    @property
    def peak(self) -> int:
        return max(self.peak_rss, self.hwm, (self.probe.get("peak") or {}).get("rss", 0))


def _ssd_blocks(cache_root: Path) -> int:
    return sum(1 for _ in (cache_root / "ssd").glob("*/blocks/*.safetensors")) \
        if (cache_root / "ssd").is_dir() else 0


def run_round(label: str, cache_root: Path, ceiling: str, model_dir: Path, served_id: str,
              banned: Sequence[int], *, probe: bool = True) -> Round:
    port = free_port()
    probe_out = Path(tempfile.mkdtemp(prefix="omlx-warm-probe-")) / "probe.json"
    serve = ["--log-level", "WARNING", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--memory-ceiling", ceiling]
    argv = ([sys.executable, "-m", "benchmarks.warm_tier_peak", "--probe", str(probe_out), "--", *serve]
            if probe else [sys.executable, "-m", "omlx_core", *serve])
    spec = ServerSpec("omlx", label, argv, served_id, env=(("OMLX_CACHE_DIR", str(cache_root)),))
    result = Round(label, ssd_blocks_at_start=_ssd_blocks(cache_root))
    jobs = prompts(model_dir, MIX)
    with ServerProcess(spec, port) as server:
        # Pages of the code a chat runs are touched once; this prompt shares no block
        # with the mix, so the tier stays as warm as it was.
        stream_chat(server.host, port, chat_body(served_id, [{"role": "user", "content": "Hi"}], 4,
                                                 banned))
        reset = reset_peak(server.pid)
        result.load = os.getloadavg()[:2]

        def one(index: int) -> str:
            _kind, messages, max_tokens = jobs[index]
            try:
                record = stream_chat(server.host, port, chat_body(served_id, messages, max_tokens,
                                                                  banned))
            except RuntimeError as error:
                text = str(error)
                return text.split()[1] if text.startswith("HTTP ") else "in-band error"
            return "200" if record.complete else "truncated"

        with PeakRss(server.pid, 1.0 / SAMPLE_HZ) as sampled:
            outcomes, result.wall_s = run_concurrently(len(jobs), one)
        result.load = (result.load[0], os.getloadavg()[0])
        result.requests = len(outcomes)
        result.completed = outcomes.count("200")
        for status in outcomes:
            result.statuses[status] = result.statuses.get(status, 0) + 1
        result.peak_rss = sampled.peak
        result.hwm = status_fields(server.pid)["VmHWM"] if reset else 0
    if probe and probe_out.exists():
        result.probe = json.loads(probe_out.read_text(encoding="utf-8"))
    shutil.rmtree(probe_out.parent, ignore_errors=True)
    return result


def render(rounds: Sequence[Round], header: Sequence[str], ceiling: int) -> str:
    lines = ["# Peak RSS under the ceiling with the SSD tier warm", "", *header, "",
             "| round | SSD blocks | completed | wall s | load 1m (start, end) | peak VmRSS | VmHWM | "
             "probe peak RSS | at it: mlx active, cache; prefix cache, queued SSD writes; "
             "file-backed | doing | verdict |",
             "|---|---:|---|---:|---|---:|---:|---:|---|---|---|"]
    for r in rounds:
        p = r.probe.get("peak") or {}
        over = r.peak - ceiling
        lines.append(
            f"| {r.label} | {r.ssd_blocks_at_start} | {r.completed}/{r.requests} | {r.wall_s:.0f} | "
            f"{r.load[0]:.1f}, {r.load[1]:.1f} | {r.peak_rss / MIB:.1f} MiB | {r.hwm / MIB:.1f} MiB | "
            f"{p.get('rss', 0) / MIB:.1f} MiB | {p.get('active', 0) / MIB:.1f}, "
            f"{p.get('cache', 0) / MIB:.1f}; {p.get('held', 0) / MIB:.1f}, "
            f"{p.get('pending', 0) / MIB:.1f}; {p.get('file', 0) / MIB:.1f} MiB | "
            f"{p.get('phase', '')} | "
            f"{'%.1f MiB over' % (over / MIB) if over > 0 else '%.1f MiB under' % (-over / MIB)} |")
    lines += ["", "Admission steps (the scheduler's `_admit`) that read blocks from the SSD tier:", "",
              "| round | admitted | read from SSD | RSS before -> after | mlx active before -> after "
              "(peak) | prefix cache before -> after |", "|---|---:|---:|---|---|---|"]
    for r in rounds:
        for a in r.probe.get("admits", []):
            if not a["loaded_bytes"]:
                continue
            lines.append(
                f"| {r.label} | {a['admitted']} | {a['loaded_bytes'] / MIB:.1f} MiB | "
                f"{a['rss_before'] / MIB:.1f} -> {a['rss_after'] / MIB:.1f} MiB | "
                f"{a['active_before'] / MIB:.1f} -> {a['active_after'] / MIB:.1f} "
                f"({a['mlx_peak'] / MIB:.1f}) MiB | {a['held_before'] / MIB:.1f} -> "
                f"{a['held_after'] / MIB:.1f} MiB |")
    measured = [r for r in rounds if r.label != "fill"]
    if measured:
        peaks = [r.peak for r in measured]
        lines += ["", f"- median peak of the {len(measured)} warm round(s): "
                      f"{statistics.median(peaks) / MIB:.1f} MiB against the "
                      f"{ceiling / MIB:.1f} MiB ceiling (max {max(peaks) / MIB:.1f} MiB)"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--probe"]:
        rest = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        return probe_main(Path(argv[1]), rest)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warm_tier_peak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ceiling", default="0.9GiB", help="--memory-ceiling (default 0.9GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="warm rounds (default 3)")
    parser.add_argument("--cache-root", type=Path, default=None,
                        help="an OMLX_CACHE_DIR whose SSD tier is already warm (default: a fresh "
                             "one, filled by a first server)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    from omlx_core.config import load_config
    from omlx_core.models.default import ensure_default_model

    ceiling = parse_size(args.ceiling)
    model_dir = ensure_default_model()
    served_id = load_config(None)["server.models"][0]
    banned = special_token_ids(model_dir)
    rounds = []
    cache_root = args.cache_root or fresh_cache_root()
    if args.cache_root is None or not _ssd_blocks(cache_root):
        rounds.append(run_round("fill", cache_root, args.ceiling, model_dir, served_id, banned))
    for number in range(args.rounds):
        rounds.append(run_round(f"warm {number + 1}", cache_root, args.ceiling, model_dir,
                                served_id, banned))
    mix = ", ".join(f"{count} {kind} ({tokens}-token passage, max_tokens {max_tokens})"
                    for kind, tokens, max_tokens, count in MIX)
    header = [f"- {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.machine()}, "
              f"{os.cpu_count()} CPUs; `omlx-core serve --memory-ceiling {args.ceiling}` "
              f"({format_size(ceiling)}) on the default model",
              f"- {sum(m[3] for m in MIX)} concurrent streaming chats: {mix}",
              "- fill: a server on a fresh SSD-cache directory; warm: a new server on the same "
              "directory (the tier warm, the memory cold)"]
    publish_report(render(rounds, header, ceiling), args.out)
    if args.cache_root is None:
        shutil.rmtree(cache_root, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
