"""Typed configuration keys: what a key accepts, how a string from the environment or
the command line becomes a value, and the message when it doesn't."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from ``1536``, ``"1.5GiB"``, ``"512MiB"``, ``"2GB"``. Raises ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError("a size, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(f"{value!r} is not a size")


def format_size(n: int) -> str:
    """``1610612736`` -> ``"1.50 GiB"``; used wherever bytes are shown to a person."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Setting:
    """One configuration key.

    ``kind`` is one of ``str``, ``int``, ``float``, ``bool``, ``size``, ``list``,
    ``choice``. ``minimum``/``maximum`` bound numbers and sizes; ``choices`` lists the
    values of a ``choice``; ``allow`` lists extra literal strings accepted as-is (e.g.
    ``"auto"`` for a size).
    """

    key: str
    kind: str
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = field(default=None, compare=False)
    # Only plugin settings carry a default here; core defaults live in tiers/base.toml.
    default: Any = None

    @property
    def expected(self) -> str:
        """The accepted form, in words, for error messages."""
        forms = {
            "str": "a string",
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "size": 'a size in bytes, e.g. 1073741824 or "1GiB"',
            "list": 'a list of strings, e.g. ["a", "b"]',
            "choice": "one of " + ", ".join(repr(c) for c in self.choices),
        }
        text = forms[self.kind]
        if self.minimum is not None and self.maximum is not None:
            text += f" between {self.minimum:g} and {self.maximum:g}"
        elif self.minimum is not None:
            text += f" >= {self.minimum:g}"
        if self.allow:
            text += " or " + " or ".join(repr(a) for a in self.allow)
        return text

    def coerce(self, value: Any, *, from_text: bool = False) -> Any:
        """Validate ``value`` (parsing it first when it came as text); raise ``ValueError``."""
        if isinstance(value, str) and value in self.allow:
            return value
        if from_text:
            value = self._parse_text(value)
        result = self._coerce_typed(value)
        if self.kind in ("int", "float", "size"):
            if self.minimum is not None and result < self.minimum:
                raise ValueError(f"{result!r} is below the minimum {self.minimum:g}")
            if self.maximum is not None and result > self.maximum:
                raise ValueError(f"{result!r} is above the maximum {self.maximum:g}")
        if self.check is not None:
            problem = self.check(result)
            if problem:
                raise ValueError(problem)
        return result

    def _parse_text(self, text: str) -> Any:
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{text!r} is not an integer") from None
        if self.kind == "float":
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"{text!r} is not a number") from None
        if self.kind == "bool":
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{text!r} is not true or false")
        if self.kind == "list":
            return [item.strip() for item in text.split(",") if item.strip()]
        return text

    def _coerce_typed(self, value: Any) -> Any:
        kind = self.kind
        if kind == "size":
            return parse_size(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
        elif kind == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif kind == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                # A comparison with NaN is always false: it would pass every bound and
                # then make every decision that reads it (a timeout never ending).
                if not math.isfinite(value):
                    raise ValueError(f"{value!r} is not a finite number; expected {self.expected}")
                return float(value)
        elif kind == "str":
            if isinstance(value, str):
                return value
        elif kind == "list":
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return list(value)
        elif kind == "choice":
            if isinstance(value, str) and value in self.choices:
                return value
        raise ValueError(f"{value!r} is not {self.expected}")
