"""``omlx-core top``: the dashboard in a terminal. It reads the same JSON endpoints as the
page (``/dashboard/api/history`` for the latest memory sample, ``/dashboard/api/models``
and ``/dashboard/api/requests``) and prints memory against the hard limit, every
available model with its pool state, and the requests in flight; once (``--once``), or
redrawn every ``--interval`` seconds until Ctrl-C (``-n`` frames, when given)."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any, Callable, Sequence, TextIO

from omlx_core.pool.ps import PsError, duration_text, fetch_json, until_text
from omlx_core.settings import format_size

MODEL_COLUMNS = ("NAME", "STATE", "PINNED", "ENGINE", "PLANNED", "RESIDENT", "CONTEXT",
                 "USED", "UNTIL", "IN FLIGHT", "WAITING", "PREFIX CACHE", "LAST ERROR")
REQUEST_COLUMNS = ("REQUEST", "MODEL", "STAGE", "PROGRESS", "AGE")
#: requests shown in one frame (the rest are counted)
REQUESTS_SHOWN = 10
ERROR_WIDTH = 60
CLEAR = "\x1b[H\x1b[2J"


def fetch_snapshot(url: str, api_key: str | None = None, timeout_s: float = 10.0
                   ) -> dict[str, Any]:
    """What one frame shows: the latest sample, the models and the requests, as the
    dashboard's endpoints answer them.

    :raises PsError: the server did not answer or refused (a missing key names the flag).
    """
    # Only the latest sample: ``since`` now leaves the history's columns empty.
    history = fetch_json(url, f"/dashboard/api/history?since={time.time():.3f}", api_key,
                         timeout_s)
    models = fetch_json(url, "/dashboard/api/models", api_key, timeout_s)
    requests = fetch_json(url, "/dashboard/api/requests", api_key, timeout_s)
    return {"latest": history.get("latest"), "models": models.get("models", []),
            "pool": models.get("pool", False), "requests": requests.get("requests", [])}


def _size(value: Any) -> str:
    return format_size(int(value)) if isinstance(value, (int, float)) and value else ""


def _prefix(model: dict[str, Any]) -> str:
    cache = model.get("prefix_cache")
    if not isinstance(cache, dict):
        return ""
    if cache.get("enabled") is False:
        return "off"
    return f"{cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses"


def _short(text: Any, width: int) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _engine_text(model: dict[str, Any]) -> str:
    """The engine, and the task when it is not chat: ``encoder (embed)``."""
    task = model.get("task")
    engine = str(model.get("engine") or "")
    return f"{engine} ({task})" if task and task != "generate" else engine


def model_rows(models: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = []
    for m in models:
        used = m.get("last_used_s_ago")
        context = m.get("max_context") or m.get("context_length")
        rows.append((
            str(m["model"]), str(m.get("state") or ""), "yes" if m.get("pinned") else "no",
            _engine_text(m), _size(m.get("planned_bytes")),
            _size(m.get("resident_bytes")), str(context or ""),
            f"{duration_text(used)} ago" if used is not None else "never",
            until_text(m), str(m.get("in_flight", "")), str(m.get("waiting", "")),
            _prefix(m), _short(m.get("error"), ERROR_WIDTH)))
    return rows


def request_rows(requests: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [(str(r["request_id"]), str(r.get("model") or ""), str(r.get("stage") or ""),
             _short(r.get("detail"), 50), f"{r.get('age_s', 0):.1f} s")
            for r in requests[:REQUESTS_SHOWN]]


def memory_line(latest: dict[str, Any] | None) -> str:
    if not latest:
        return "memory     no sample yet (the memory enforcer has not polled)"
    binding = latest.get("binding")
    limit = _size(latest.get("hard_limit_bytes")) or "none"
    return (f"memory     in use {_size(latest.get('in_use_bytes')) or '0 B'}, reclaimable "
            f"{_size(latest.get('reclaimable_bytes')) or '0 B'}, reserved by admission "
            f"{_size(latest.get('reserved_bytes')) or '0 B'}; hard limit {limit}"
            + (f" ({binding} ceiling binds)" if binding else ""))


def render(snapshot: dict[str, Any], url: str, table: Callable[..., str]) -> str:
    """One frame as text; ``table(header, rows)`` lays out the columns."""
    latest = snapshot.get("latest") or {}
    models, requests = snapshot["models"], snapshot["requests"]
    resident = sum(1 for m in models if m.get("state") == "resident")
    lines = [f"omlx-core top  {url}  {datetime.now().strftime('%H:%M:%S')}",
             memory_line(snapshot.get("latest")),
             f"requests   {latest.get('running', 0)} running, {latest.get('queue_depth', 0)} "
             f"queued, {latest.get('preempted', 0)} preempted",
             f"models     {resident} resident of {len(models)} available"
             + ("" if snapshot.get("pool") else " (no model pool: fixed engines)"),
             "", table(MODEL_COLUMNS, model_rows(models)), ""]
    if requests:
        lines.append(table(REQUEST_COLUMNS, request_rows(requests)))
        if len(requests) > REQUESTS_SHOWN:
            lines.append(f"… and {len(requests) - REQUESTS_SHOWN} more")
    else:
        lines.append("no request in flight")
    return "\n".join(lines)


def run_top(url: str, api_key: str | None, *, table: Callable[..., str], once: bool = False,
            frames: int | None = None, interval_s: float = 1.0, as_json: bool = False,
            out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print frames until ``frames`` are done (``once``: one), or until Ctrl-C. A frame
    the server does not answer shows the error; with ``once`` it ends the command (1)."""
    out = out or sys.stdout
    err = err or sys.stderr
    if interval_s <= 0:
        print(f"omlx-core top: --interval {interval_s:g} must be above 0 seconds", file=err)
        return 2
    if frames is not None and frames < 1:
        print(f"omlx-core top: -n {frames} must be at least 1 frame", file=err)
        return 2
    if once or as_json:
        frames = 1
    clear = out.isatty() and frames != 1
    shown = 0
    try:
        while True:
            try:
                snapshot = fetch_snapshot(url, api_key)
            except PsError as exc:
                if frames == 1:
                    print(f"omlx-core top: {exc}", file=err)
                    return 1
                text = f"omlx-core top  {url}\n{exc}\n(retrying every {interval_s:g} s)"
            else:
                text = (json.dumps(snapshot, indent=2) if as_json
                        else render(snapshot, url, table))
            if clear:
                out.write(CLEAR)
            elif shown:
                out.write("\n")
            out.write(text + "\n")
            out.flush()
            shown += 1
            if frames is not None and shown >= frames:
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
