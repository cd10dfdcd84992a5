"""``omlx-core bench`` (omlx-core against ``mlx_lm.server``, see :mod:`.serving`) and the
harness it runs on: a timing streaming client (:mod:`.client`), server processes
(:mod:`.servers`), prompts of a chosen token length (:mod:`.prompts`).

It ships with the package because the command does. The developer benchmarks, which
use this harness too, live outside it, in the repository's ``benchmarks/``."""

from __future__ import annotations

from pathlib import Path


def publish_report(report: str, out: Path | None) -> None:
    """Print a benchmark's markdown ``report`` and, when ``out`` is given, write it there."""
    print("\n" + report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report, encoding="utf-8")
        print(f"written to {out}")
