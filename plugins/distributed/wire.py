"""The step messages between ranks, as typed, versioned JSON: what rank 0 broadcasts and
what the other ranks accept of it.

The ring backend is unauthenticated: any process that reaches a rank's ring port can put
bytes into its collectives. These messages were pickled, so such bytes ran as code on
every rank. Now a message is UTF-8 JSON of at most :data:`MAX_MESSAGE_BYTES`, with a
version and a kind, and each kind has a fixed shape: every field named, of one type, in
range. A message that is anything else raises :class:`WireError` (the rank declares the
group dead and exits, its requests ending with an in-band error), and nothing in one is
ever evaluated. The data it carries becomes the same objects the engine uses
(:class:`~omlx_core.engine.GenerationRequest`, a grammar through
:class:`~omlx_core.grammar.GrammarSpec`, with the server's grammar caps;
:class:`~omlx_core.memory.types.RequestRejected`, :class:`~omlx_core.memory.gate.DecodePlan`).

Kinds: ``hello`` (where rank 0 listens for heartbeats, once), ``step`` (new requests with
their seeds, aborts), ``stop`` (rank 0 shut its scheduler down), ``refusals``, ``plan``,
``flag`` and ``count`` (the forward gate's answers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.scheduling import (
    CAUSES,
    STAGES,
    CeilingBreakdown,
    DecodePlan,
    GrammarError,
    GrammarSpec,
    Rejection,
    RequestRejected,
)

__all__ = ["MAX_MESSAGE_BYTES", "WIRE_VERSION", "Hello", "Step", "WireError", "decode_count",
           "decode_flag", "decode_hello", "decode_plan", "decode_refusals", "decode_step",
           "encode_count", "encode_flag", "encode_hello", "encode_plan", "encode_refusals",
           "encode_step", "encode_stop"]

WIRE_VERSION = 2  # 2: a request's cache points
#: the largest message a rank accepts (a step's new prompts: 64 MiB of JSON is millions
#: of tokens)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MAX_INT = 1 << 62
_MAX_TEXT = 1 << 20
_MAX_ITEMS = 1 << 22
_GRAMMAR_KINDS = ("json_schema", "any_json", "regex", "ebnf", "structural_tag")


class WireError(ValueError):
    """Bytes that are not a step message of this version and shape."""


# -- checks -------------------------------------------------------------------------------------


def _int(value: Any, where: str, low: int = 0, high: int = _MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise WireError(f"{where}: expected an integer in [{low}, {high}], got {_shown(value)}")
    return value


def _float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WireError(f"{where}: expected a finite number, got {_shown(value)}")
    return float(value)


def _str(value: Any, where: str, limit: int = _MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise WireError(f"{where}: expected a string of at most {limit} characters")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise WireError(f"{where}: expected true or false, got {_shown(value)}")
    return value


def _optional(check: Callable[..., Any]) -> Callable[..., Any]:
    return lambda value, where: None if value is None else check(value, where)


def _list(value: Any, where: str, item: Callable[[Any, str], Any]) -> list[Any]:
    if not isinstance(value, list) or len(value) > _MAX_ITEMS:
        raise WireError(f"{where}: expected a list of at most {_MAX_ITEMS} items")
    return [item(entry, f"{where}[{index}]") for index, entry in enumerate(value)]


def _choice(options: Sequence[str]) -> Callable[[Any, str], str]:
    def check(value: Any, where: str) -> str:
        if value not in options:
            raise WireError(f"{where}: expected one of {', '.join(options)}, got {_shown(value)}")
        return value
    return check


def _object(value: Any, where: str, shape: Mapping[str, Callable[[Any, str], Any]]) -> dict[str, Any]:
    """``value`` checked to be an object with exactly ``shape``'s fields, each checked."""
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected an object, got {_shown(value)}")
    if set(value) != set(shape):
        missing, extra = sorted(set(shape) - set(value)), sorted(set(value) - set(shape))
        raise WireError(f"{where}: fields differ from this version's (missing {missing}, "
                        f"unknown {extra[:5]})")
    return {name: check(value[name], f"{where}.{name}") for name, check in shape.items()}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- the envelope ---------------------------------------------------------------------------------


def _encode(kind: str, body: Mapping[str, Any]) -> bytes:
    data = json.dumps({"v": WIRE_VERSION, "kind": kind, "body": body}, allow_nan=False,
                      ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"a {kind} message of {len(data)} bytes, over {MAX_MESSAGE_BYTES}")
    return data


def _reject_constant(name: str) -> Any:
    raise WireError(f"{name} is not a number this protocol carries")


def _decode(data: bytes, kinds: Sequence[str]) -> tuple[str, Any]:
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {len(data) if isinstance(data, (bytes, bytearray)) else '?'} "
                        f"bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        message = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
    except WireError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not a JSON message ({type(exc).__name__})") from None
    envelope = _object(message, "message", {"v": _int, "kind": _str, "body": lambda v, w: v})
    if envelope["v"] != WIRE_VERSION:
        raise WireError(f"message version {envelope['v']}, this rank speaks {WIRE_VERSION}: run "
                        "the same omlx-core on every rank")
    if envelope["kind"] not in kinds:
        raise WireError(f"a {_shown(envelope['kind'])} message where {' or '.join(kinds)} was due")
    return envelope["kind"], envelope["body"]


# -- hello: where rank 0 listens for heartbeats --------------------------------------------------


@dataclass(frozen=True)
class Hello:
    address: str
    port: int
    #: what a rank's heartbeat connection opens with (hex)
    token: str


def encode_hello(hello: Hello) -> bytes:
    return _encode("hello", {"address": hello.address, "port": hello.port, "token": hello.token})


def decode_hello(data: bytes) -> Hello:
    _, body = _decode(data, ("hello",))
    fields_ = _object(body, "hello", {"address": lambda v, w: _str(v, w, 256),
                                      "port": lambda v, w: _int(v, w, 1, 65535),
                                      "token": lambda v, w: _str(v, w, 128)})
    return Hello(**fields_)


# -- step: new requests and aborts ---------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What rank 0 drained in one step; ``stop``: it shut its scheduler down."""

    arrivals: tuple[tuple[GenerationRequest, int], ...] = ()
    aborts: tuple[str, ...] = ()
    stop: bool = False


def _grammar_body(spec: GrammarSpec | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"kind": spec.kind, "text": spec.text, "strict": spec.strict,
            "max_whitespace": spec.max_whitespace, "field": spec.field}


def _sampling_body(sampling: SamplingParams) -> dict[str, Any]:
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "min_p": sampling.min_p, "seed": sampling.seed, "max_tokens": sampling.max_tokens,
            "stop": list(sampling.stop), "stop_token_ids": list(sampling.stop_token_ids),
            "repetition_penalty": sampling.repetition_penalty,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "logit_bias": [[int(token), float(bias)] for token, bias in sampling.logit_bias.items()],
            "logprobs": sampling.logprobs, "grammar": _grammar_body(sampling.grammar)}


def encode_step(arrivals: Sequence[tuple[GenerationRequest, int]], aborts: Sequence[str]) -> bytes:
    """Rank 0's step: each new request with its seed, and the ids it aborted."""
    requests = []
    for request, seed in arrivals:
        if request.images is not None:
            raise WireError(f"request {request.request_id} has images, which the distributed "
                            "engine does not take")
        requests.append({"request_id": request.request_id,
                         "prompt_tokens": [int(t) for t in request.prompt_tokens],
                         "sampling": _sampling_body(request.sampling),
                         "cache_salt": request.cache_salt,
                         "cache_points": [int(p) for p in request.cache_points], "seed": int(seed)})
    return _encode("step", {"arrivals": requests, "aborts": list(aborts)})


def encode_stop() -> bytes:
    return _encode("stop", {})


_TOKEN = lambda v, w: _int(v, w, 0, (1 << 31) - 1)  # noqa: E731
_ID = lambda v, w: _str(v, w, 256)  # noqa: E731


def _grammar(value: Any, where: str) -> GrammarSpec:
    body = _object(value, where, {"kind": _choice(_GRAMMAR_KINDS), "text": _str,
                                  "strict": _bool, "max_whitespace": _optional(_int),
                                  "field": lambda v, w: _str(v, w, 256)})
    try:  # the server's grammar caps hold here as on rank 0
        return GrammarSpec(body["kind"], body["text"], body["strict"], body["max_whitespace"],
                           body["field"])
    except GrammarError as exc:
        raise WireError(f"{where}: {exc}") from None


def _bias(value: Any, where: str) -> tuple[int, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise WireError(f"{where}: expected [token, bias]")
    return _TOKEN(value[0], where + "[0]"), _float(value[1], where + "[1]")


def _sampling(value: Any, where: str) -> SamplingParams:
    body = _object(value, where, {
        "temperature": _float, "top_p": _float, "top_k": _int, "min_p": _float,
        "seed": _optional(lambda v, w: _int(v, w, 0, (1 << 63) - 1)),
        "max_tokens": _optional(_int), "stop": lambda v, w: _list(v, w, _str),
        "stop_token_ids": lambda v, w: _list(v, w, _TOKEN),
        "repetition_penalty": _float, "presence_penalty": _float, "frequency_penalty": _float,
        "logit_bias": lambda v, w: _list(v, w, _bias), "logprobs": _optional(_int),
        "grammar": _optional(_grammar)})
    return SamplingParams(
        temperature=body["temperature"], top_p=body["top_p"], top_k=body["top_k"],
        min_p=body["min_p"], seed=body["seed"], max_tokens=body["max_tokens"],
        stop=tuple(body["stop"]), stop_token_ids=tuple(body["stop_token_ids"]),
        repetition_penalty=body["repetition_penalty"], presence_penalty=body["presence_penalty"],
        frequency_penalty=body["frequency_penalty"], logit_bias=dict(body["logit_bias"]),
        logprobs=body["logprobs"], grammar=body["grammar"])


def _arrival(value: Any, where: str) -> tuple[GenerationRequest, int]:
    body = _object(value, where, {"request_id": _ID,
                                  "prompt_tokens": lambda v, w: _list(v, w, _TOKEN),
                                  "sampling": _sampling, "cache_salt": _optional(_ID),
                                  "cache_points": lambda v, w: _list(v, w, _TOKEN),
                                  "seed": lambda v, w: _int(v, w, 0, (1 << 64) - 1)})
    if not body["prompt_tokens"]:
        raise WireError(f"{where}.prompt_tokens: empty")
    if any(point >= len(body["prompt_tokens"]) for point in body["cache_points"]):
        raise WireError(f"{where}.cache_points: a position past the prompt's "
                        f"{len(body['prompt_tokens'])} tokens")
    # Every rank would plan its prefill chunks from the same points, so its forwards match
    # (empty while the distributed engine runs without a prefix cache).
    request = GenerationRequest(body["request_id"], body["prompt_tokens"], body["sampling"],
                                cache_salt=body["cache_salt"], cache_points=tuple(body["cache_points"]))
    return request, body["seed"]


def decode_step(data: bytes) -> Step:
    """A ``step`` or ``stop`` message; :class:`WireError` for anything else."""
    kind, body = _decode(data, ("step", "stop"))
    if kind == "stop":
        _object(body, "stop", {})
        return Step(stop=True)
    step = _object(body, "step", {"arrivals": lambda v, w: _list(v, w, _arrival),
                                  "aborts": lambda v, w: _list(v, w, _ID)})
    return Step(tuple(step["arrivals"]), tuple(step["aborts"]))


# -- the forward gate's answers ---------------------------------------------------------------------

_BREAKDOWN_SHAPE: dict[str, Callable[[Any, str], Any]] = {
    **{name: _optional(_int) for name in ("static", "dynamic", "device", "custom", "total_ram",
                                          "reclaimable", "own_footprint")},
    "tier": lambda v, w: _str(v, w, 64),
    "device_kind": _optional(lambda v, w: _str(v, w, 64)),
    "notes": lambda v, w: _list(v, w, _str), "elsewhere": _str,
    "rank": _optional(lambda v, w: _int(v, w, 0, 1 << 20)),
    "ranks": lambda v, w: _int(v, w, 1, 1 << 20),
}
_REJECTION_SHAPE: dict[str, Callable[[Any, str], Any]] = {
    "estimated_bytes": lambda v, w: _int(v, w, -_MAX_INT), "limit_bytes": _optional(_int),
    "breakdown": _optional(lambda v, w: CeilingBreakdown(**{
        **_object(v, w, _BREAKDOWN_SHAPE), "notes": tuple(v["notes"])})),
    "request_id": _ID, "model_id": _ID, "prompt_tokens": _int, "stage": _choice(STAGES),
    "base_bytes": lambda v, w: _int(v, w, -_MAX_INT), "cause": _choice(CAUSES), "detail": _str,
    "decode_bytes": _int, "max_tokens": _int, "fitting_max_tokens": _optional(_int),
    "fitting_kv_bits": _optional(_int),
    "margin_bytes": _int, "pinned_models": lambda v, w: tuple(_list(v, w, _ID)),
}


def _rejection_body(rejection: Rejection) -> dict[str, Any]:
    body = {field.name: getattr(rejection, field.name) for field in fields(rejection)}
    breakdown = rejection.breakdown
    body["breakdown"] = None if breakdown is None else {
        **{field.name: getattr(breakdown, field.name) for field in fields(breakdown)},
        "notes": list(breakdown.notes)}
    body["pinned_models"] = list(rejection.pinned_models)
    return body


def encode_refusals(refusals: Mapping[str, RequestRejected]) -> bytes:
    return _encode("refusals", {"refusals": [
        {"request_id": request_id, "rejection": _rejection_body(error.rejection),
         "advice": list(error.advice), "retry_after_s": error.retry_after_s,
         "wait": bool(error.wait)}
        for request_id, error in refusals.items()]})


def _refusal(value: Any, where: str) -> tuple[str, RequestRejected]:
    body = _object(value, where, {
        "request_id": _ID, "rejection": lambda v, w: Rejection(**_object(v, w, _REJECTION_SHAPE)),
        "advice": lambda v, w: _list(v, w, _str), "retry_after_s": _optional(_float),
        "wait": _bool})
    return body["request_id"], RequestRejected(body["rejection"], body["advice"],
                                               body["retry_after_s"], wait=body["wait"])


def decode_refusals(data: bytes) -> dict[str, RequestRejected]:
    _, body = _decode(data, ("refusals",))
    refusals = _object(body, "refusals", {"refusals": lambda v, w: _list(v, w, _refusal)})
    return dict(refusals["refusals"])


def encode_plan(plan: DecodePlan) -> bytes:
    return _encode("plan", {"allowed_tokens": [[rid, int(tokens)]
                                               for rid, tokens in plan.allowed_tokens.items()],
                            "preempt": list(plan.preempt)})


def _allowance(value: Any, where: str) -> tuple[str, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise WireError(f"{where}: expected [request id, tokens]")
    return _ID(value[0], where + "[0]"), _int(value[1], where + "[1]")


def decode_plan(data: bytes) -> DecodePlan:
    _, body = _decode(data, ("plan",))
    plan = _object(body, "plan", {"allowed_tokens": lambda v, w: _list(v, w, _allowance),
                                  "preempt": lambda v, w: _list(v, w, _ID)})
    return DecodePlan(dict(plan["allowed_tokens"]), tuple(plan["preempt"]))


def encode_flag(value: bool) -> bytes:
    return _encode("flag", {"value": bool(value)})


def decode_flag(data: bytes) -> bool:
    _, body = _decode(data, ("flag",))
    return _object(body, "flag", {"value": _bool})["value"]


def encode_count(value: int) -> bytes:
    return _encode("count", {"value": int(value)})


def decode_count(data: bytes) -> int:
    _, body = _decode(data, ("count",))
    return _object(body, "count", {"value": lambda v, w: _int(v, w, -_MAX_INT)})["value"]
