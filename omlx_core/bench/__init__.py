"""Benchmarks of served models over HTTP: a streaming OpenAI client, server processes,
and ``omlx-core bench`` (omlx-core against ``mlx_lm.server``, see :mod:`.serving`)."""

from __future__ import annotations

from pathlib import Path


def publish_report(report: str, out: Path | None) -> None:
    """Print a benchmark's markdown ``report`` and, when ``out`` is given, write it there."""
    print("\n" + report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report, encoding="utf-8")
        print(f"written to {out}")
