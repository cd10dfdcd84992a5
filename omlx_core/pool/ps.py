"""``omlx-core ps``: a running server's model pool as a table, like ``ollama ps``.

It reads ``GET /v1/models`` (every available model with the pool's view of it) and
prints the models that are resident, loading or failed; ``--all`` prints every one."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Sequence

from omlx_core.settings import format_size

COLUMNS = ("NAME", "STATE", "SIZE", "PINNED", "ENGINE", "TASK", "CONTEXT", "KV CACHE",
           "IN FLIGHT", "UNTIL")


class PsError(Exception):
    """The server could not be asked (not running, wrong port, refused key)."""


def fetch_json(url: str, path: str, api_key: str | None = None,
               timeout_s: float = 10.0) -> Any:
    """The JSON of ``GET {url}{path}`` (``omlx-core ps`` and ``top`` read the server so).

    :raises PsError: the server did not answer, or answered with an error (its status
        and body are in the message).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        hint = " (pass --api-key or set OMLX_API_KEY)" if exc.code == 401 else ""
        raise PsError(f"{url} answered {exc.code}{hint}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PsError(f"no omlx-core server answers at {url} ({exc}); start one with "
                      "`omlx-core serve`, or pass --host/--port") from None


def fetch_models(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The ``data`` of ``GET {url}/v1/models``."""
    return list(fetch_json(url, "/v1/models", api_key, timeout_s)["data"])


def until_text(model: dict[str, Any]) -> str:
    if model.get("state") != "resident":
        return ""
    if model.get("pinned"):
        return "pinned"
    expires = model.get("expires_in_s")
    if expires is None:
        return "forever"
    if model.get("in_flight"):
        return f"{duration_text(expires)} after idle"
    return f"{duration_text(expires)} from now"


def duration_text(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _kv_text(described: str | None) -> str:
    """The KV format's first clause (``"8-bit (group 64)"``): a column, not a sentence."""
    return (described or "").split(";")[0]


def ps_rows(models: Sequence[dict[str, Any]], *, everything: bool = False) -> list[tuple[str, ...]]:
    rows = []
    for model in models:
        state = model.get("state", "resident")
        if not everything and state == "available":
            continue
        size = model.get("measured_bytes") or model.get("planned_bytes")
        rows.append((str(model["id"]), state, format_size(size) if size else "",
                     "yes" if model.get("pinned") else "no", str(model.get("engine") or ""),
                     str(model.get("task") or "generate"), str(model.get("context_length") or ""),
                     _kv_text(model.get("kv_cache")), str(model.get("in_flight", "")),
                     until_text(model)))
    return rows
