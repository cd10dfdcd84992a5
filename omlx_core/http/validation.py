"""Checks a decoded JSON body against the same JSON Schema that ``/openapi.json`` publishes.

One schema serves both purposes, so the document cannot drift from what the server
accepts. The checker covers the keywords the request schemas use (``type``, ``enum``,
``const``, bounds, lengths, ``pattern``, ``items``, ``properties``, ``required``,
``additionalProperties``, ``propertyNames``, ``min/maxProperties``, ``anyOf``, ``not``)
and names the failing parameter the way OpenAI does: ``messages[0].content``. A
schema's ``x-error`` replaces the generic message when that schema is violated.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

_JSON_TYPES = {
    "object": "an object", "array": "an array", "string": "a string", "integer": "an integer",
    "number": "a number", "boolean": "a boolean", "null": "null",
}


class SchemaViolation(Exception):
    """A request body that does not match its schema; ``param`` names the offending field."""

    def __init__(self, param: str | None, message: str, keyword: str = ""):
        super().__init__(message)
        self.param = param
        self.message = message
        self.keyword = keyword


def _is_type(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and math.isfinite(value)
    raise ValueError(f"unknown JSON type {kind!r} in a request schema")


def describe(schema: Mapping[str, Any]) -> str:
    """A short phrase for what a schema accepts: "a string or an array"."""
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(describe(option) for option in schema["anyOf"])
    kinds = schema.get("type")
    if kinds is None:
        return "a JSON value"
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return " or ".join(_JSON_TYPES[k] for k in kinds)


def _name(path: str) -> str:
    return path or "the request body"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(value: Any, schema: Mapping[str, Any], path: str = "") -> None:
    """Raise :class:`SchemaViolation` for the first part of ``value`` that ``schema`` rejects."""
    try:
        _check(value, schema, path)
    except RecursionError:
        raise SchemaViolation(path or None, "the request body is nested too deeply") from None


def _fail(schema: Mapping[str, Any], path: str, message: str, keyword: str = "") -> SchemaViolation:
    custom = schema.get("x-error")
    if custom:
        return SchemaViolation(path or None, f"{_name(path)}: {custom}", keyword)
    return SchemaViolation(path or None, message, keyword)


def _check(value: Any, schema: Mapping[str, Any], path: str) -> None:
    if "not" in schema:
        try:
            _check(value, schema["not"], path)
        except SchemaViolation:
            pass
        else:
            raise _fail(schema, path, f"{_name(path)} is not accepted")
    if "anyOf" in schema:
        _check_any_of(value, schema, path)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is_type(value, k) for k in kinds):
            raise _fail(schema, path, f"{_name(path)} must be {describe(schema)}, "
                                      f"got {_type_of(value)}", "type")
    if "const" in schema and (value != schema["const"] or type(value) is not type(schema["const"])):
        raise _fail(schema, path, f"{_name(path)} must be {schema['const']!r}, got {_shown(value)}")
    if "enum" in schema and not any(value == v and type(value) is type(v) for v in schema["enum"]):
        raise _fail(schema, path, f"{_name(path)} must be {describe(schema)}, got {_shown(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(value, schema, path)
    elif isinstance(value, str):
        _check_string(value, schema, path)
    elif isinstance(value, list):
        _check_array(value, schema, path)
    elif isinstance(value, dict):
        _check_object(value, schema, path)


def _check_any_of(value: Any, schema: Mapping[str, Any], path: str) -> None:
    candidates = []
    for option in schema["anyOf"]:
        try:
            _check(value, option, path)
            return
        except SchemaViolation as violation:
            kinds = option.get("type")
            kinds = [kinds] if isinstance(kinds, str) else kinds
            if kinds is None or any(_is_type(value, k) for k in kinds):
                candidates.append(violation)
    if not candidates:
        raise _fail(schema, path, f"{_name(path)} must be {describe(schema)}, got {_type_of(value)}")
    # The option the value got furthest into, without a type mismatch, explains it best.
    best = max(candidates, key=lambda v: (v.keyword != "type", _depth(v.param)))
    if best.param == (path or None):
        raise _fail(schema, path, best.message)
    raise best


def _depth(param: str | None) -> int:
    return 0 if not param else param.count(".") + param.count("[") + 1


def _type_of(value: Any) -> str:
    for kind in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, kind):
            return _JSON_TYPES[kind]
    if isinstance(value, float):
        return "a non-finite number"
    return type(value).__name__


def _check_number(value: float, schema: Mapping[str, Any], path: str) -> None:
    if not math.isfinite(value):
        raise _fail(schema, path, f"{_name(path)} must be a finite number")
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and value < low:
        raise _fail(schema, path, f"{_name(path)} must be at least {low}, got {_shown(value)}")
    if high is not None and value > high:
        raise _fail(schema, path, f"{_name(path)} must be at most {high}, got {_shown(value)}")
    low, high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if low is not None and value <= low:
        raise _fail(schema, path, f"{_name(path)} must be greater than {low}, got {_shown(value)}")
    if high is not None and value >= high:
        raise _fail(schema, path, f"{_name(path)} must be less than {high}, got {_shown(value)}")


def _check_string(value: str, schema: Mapping[str, Any], path: str) -> None:
    if "minLength" in schema and len(value) < schema["minLength"]:
        what = "must not be empty" if schema["minLength"] == 1 else \
            f"must be at least {schema['minLength']} characters"
        raise _fail(schema, path, f"{_name(path)} {what}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise _fail(schema, path, f"{_name(path)} must be at most {schema['maxLength']} "
                                  f"characters, got {len(value)}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        raise _fail(schema, path, f"{_name(path)} must match {schema['pattern']}, got {_shown(value)}")


def _check_array(value: list, schema: Mapping[str, Any], path: str) -> None:
    if "minItems" in schema and len(value) < schema["minItems"]:
        what = "must not be empty" if schema["minItems"] == 1 else \
            f"must have at least {schema['minItems']} items"
        raise _fail(schema, path, f"{_name(path)} {what}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise _fail(schema, path, f"{_name(path)} must have at most {schema['maxItems']} items, "
                                  f"got {len(value)}")
    items = schema.get("items")
    if items is not None:
        for index, item in enumerate(value):
            _check(item, items, f"{path}[{index}]")


def _check_object(value: dict, schema: Mapping[str, Any], path: str) -> None:
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        raise _fail(schema, path, f"{_name(path)} must have at least {schema['minProperties']} entries")
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        raise _fail(schema, path, f"{_name(path)} must have at most {schema['maxProperties']} "
                                  f"entries, got {len(value)}")
    properties = schema.get("properties", {})
    names = schema.get("propertyNames")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        param = f"{path}.{name}" if path else name
        if names is not None:
            _check(name, names, param)
        if name in properties:
            _check(item, properties[name], param)
        elif extra is False:
            known = ", ".join(sorted(properties))
            raise SchemaViolation(param, f"unknown parameter {param!r}; accepted here: {known}")
        elif isinstance(extra, Mapping):
            _check(item, extra, param)
    # After the fields present: a part of the wrong kind is explained by its "type", not
    # by the fields its kind does not have.
    for name in schema.get("required", ()):
        if name not in value:
            param = f"{path}.{name}" if path else name
            raise SchemaViolation(param, f"missing required parameter {param!r}")
