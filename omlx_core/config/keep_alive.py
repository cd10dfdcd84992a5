"""``keep_alive``: how long an idle model stays resident, in Ollama's forms (a number of
seconds, a duration string, ``-1`` forever, ``0`` unload when idle). Read from the
configuration (``server.keep_alive``, ``[models.<id>] keep_alive``) and from a request's
``keep_alive`` field."""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
KEEP_ALIVE_FORMS = ('a duration such as "30s", "5m" or "1h", a number of seconds, '
                    '-1 (keep forever) or 0 (unload when idle)')


def parse_keep_alive(value: object) -> float | None:
    """Seconds an idle model stays resident: ``None`` forever (``-1`` or any negative),
    ``0`` unload as soon as it is idle. Ollama's forms: a number of seconds or a
    duration string.

    :raises ValueError: ``value`` is none of :data:`KEEP_ALIVE_FORMS`.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not {KEEP_ALIVE_FORMS}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ValueError(f"{value!r} is not {KEEP_ALIVE_FORMS}")
    if math.isnan(seconds) or math.isinf(seconds) and seconds > 0:
        raise ValueError(f"{value!r} is not {KEEP_ALIVE_FORMS}")
    return None if seconds < 0 else seconds


def check_keep_alive(value: object) -> str | None:
    """The configuration check of a ``keep_alive`` value (``None``: it is valid)."""
    try:
        parse_keep_alive(value)
    except ValueError as exc:
        return str(exc)
    return None
