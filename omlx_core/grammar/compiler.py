"""Grammar compilation with xgrammar: one cache per tokenizer, bounded in bytes, of
grammars compiled in worker processes that stop at their deadline.

Compiling a grammar against a vocabulary costs milliseconds to seconds (a large JSON
schema against a 150k-token vocabulary), so each distinct grammar is compiled once per
tokenizer and kept. Before that, a grammar is checked against the caps in
:mod:`omlx_core.grammar.limits`; its compile waits its turn in
:mod:`omlx_core.grammar.compile_queue` and runs in a
:mod:`~omlx_core.grammar.compile_worker` process. Every failure is a
:class:`GrammarError` naming the request field it came from, which the HTTP layer turns
into a 400; a full queue is :class:`GrammarBusy` (503).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Literal, Sequence

from omlx_core.grammar.compile_queue import CompileJob, compile_client, compile_queue
from omlx_core.grammar.compile_worker import CompileFailed, compile_request
from omlx_core.grammar.errors import (GrammarBusy, GrammarCompileTimeout, GrammarError,
                                      GrammarUnavailable)
from omlx_core.grammar.limits import current_limits
from omlx_core.grammar.xgrammar_import import import_xgrammar
from omlx_core.memory.usage import register_reclaimable, trim_heap
from omlx_core.models.loader import hf_tokenizer
from omlx_core.settings import format_size

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MAX_WHITESPACE",
    "Compiled",
    "CompilerStats",
    "GrammarBusy",
    "GrammarCompileTimeout",
    "GrammarCompilerCache",
    "GrammarError",
    "GrammarSpec",
    "GrammarUnavailable",
    "compiled_grammar_bytes",
    "compiler_for",
    "configure_cache_bytes",
    "json_safe_strings",
    "special_token_ids",
    "special_tokens",
]

GrammarKind = Literal["json_schema", "any_json", "regex", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "any_json", "regex", "ebnf", "structural_tag")

#: bytes of compiled grammars a cache keeps (``grammar.cache_size``). A compiled grammar
#: holds a token mask per grammar state, so its size grows with the vocabulary: a
#: one-property JSON schema is 2 MiB for a 49k-token vocabulary (~30 such grammars fit),
#: a tool call's structural tag about the same. The cache is memory the guard reclaims.
DEFAULT_CACHE_BYTES = 64 * 1024**2
# Whitespace between JSON tokens is free in JSON, and a model that is unsure (or knows
# nothing, like a random test model) can fill an output with it forever. 16 characters
# still fit pretty-printed output a few levels deep.
DEFAULT_MAX_WHITESPACE = 16
# OpenAI's json_object: valid JSON, in practice an object; arrays are allowed as xgrammar's
# built-in JSON grammar allows them, but that grammar cannot bound whitespace.
ANY_JSON_SCHEMA = '{"type":["object","array"]}'
@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain the output to, in canonical form.

    ``text`` is the canonical grammar source: compact JSON for schemas and structural tags
    (key order kept: without ``any_order`` xgrammar emits properties in the order the
    schema declares them, so two orders are two grammars), the pattern or EBNF verbatim.
    ``max_whitespace`` bounds each run of whitespace between JSON tokens.
    ``field`` names the request field for error messages and is not part of the identity.
    A grammar over one of the server's caps (:mod:`omlx_core.grammar.limits`) is refused
    when it is made.
    """

    kind: GrammarKind
    text: str = ""
    strict: bool = True
    max_whitespace: int | None = None
    field: str = dataclass_field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        current_limits().check(self.kind, self.text, self.field)

    @property
    def key(self) -> tuple[str, str, bool, int | None]:
        return (self.kind, self.text, self.strict, self.max_whitespace)

    @classmethod
    def json_schema(cls, schema: Any, *, strict: bool = True,
                    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
                    field: str = "response_format.json_schema.schema") -> GrammarSpec:
        """A JSON value valid against ``schema`` (a dict, ``True``, or JSON text).

        ``strict`` forbids properties and array items the schema does not declare
        (OpenAI's ``strict: true``); without it, undeclared ones are allowed.
        """
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(field, f"is not valid JSON ({exc}); send a JSON Schema object") from None
        if schema is True:
            schema = {}
        if schema is False:
            raise GrammarError(field, "is the schema `false`, which no value satisfies")
        if not isinstance(schema, dict):
            raise GrammarError(
                field, f"must be a JSON Schema object, got {type(schema).__name__}; e.g. "
                '{"type": "object", "properties": {...}}')
        return cls("json_schema", _compact_json(schema, field), bool(strict),
                   _check_whitespace(max_whitespace, field), field)

    @classmethod
    def any_json(cls, *, max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
                 field: str = "response_format") -> GrammarSpec:
        """Any JSON object or array (OpenAI's ``json_object``)."""
        return cls("any_json", "", False, _check_whitespace(max_whitespace, field), field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "regex") -> GrammarSpec:
        """Text matching ``pattern`` in full."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(field, "must be a non-empty regular expression string")
        return cls("regex", pattern, True, None, field)

    @classmethod
    def ebnf(cls, grammar: str, *, field: str = "grammar") -> GrammarSpec:
        """Text derived from the GBNF/EBNF ``grammar`` (llama.cpp syntax, root rule ``root``)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(field, "must be a non-empty EBNF grammar string with a `root` rule")
        return cls("ebnf", grammar, True, None, field)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any] | str, *, field: str = "tools") -> GrammarSpec:
        """An xgrammar structural tag (``{"type": "structural_tag", "format": {...}}``),
        the form tool calls are constrained with (see :mod:`omlx_core.grammar.toolcalls`)."""
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except ValueError as exc:
                raise GrammarError(field, f"structural tag is not valid JSON ({exc})") from None
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
            raise GrammarError(field, 'a structural tag must be an object with "type": "structural_tag"')
        return cls("structural_tag", _compact_json(tag, field), True, None, field)


def _compact_json(value: Any, field: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(field, f"cannot be serialized as JSON ({exc})") from None


def _check_whitespace(max_whitespace: int | None, field: str) -> int | None:
    if max_whitespace is not None and (not isinstance(max_whitespace, int) or max_whitespace < 1):
        raise GrammarError(field, f"max_whitespace must be a positive integer or None, got {max_whitespace!r}")
    return max_whitespace


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar and how it was obtained."""

    spec: GrammarSpec
    #: the ``xgrammar.CompiledGrammar``
    grammar: Any
    #: seconds the compile itself took (the first time, for a cached grammar)
    compile_seconds: float
    #: whether this lookup was served from the cache
    cached: bool
    #: width of the token bitmask: the model's logits width
    vocab_size: int
    #: packed int32 bitmask row of the tokens this grammar must not produce although
    #: xgrammar allows them: control tokens it would match as their literal text, tokens
    #: that are invalid UTF-8 (None: none)
    forbidden_bitmask: Any = None
    #: the :class:`Utf8Guard` for what may follow a token that ends in a lead byte
    utf8_guard: Any = None


def bitmask_of(token_ids: Any, vocab_size: int) -> Any:
    """A packed int32 bitmask row (xgrammar's layout) with the bits of ``token_ids`` set."""
    import numpy as np

    mask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    words = mask.view(np.uint32)
    for token in token_ids:
        words[0, token // 32] |= np.uint32(1 << (token % 32))
    return mask


# Lead bytes after which xgrammar 0.2.8 admits a second byte that makes invalid UTF-8:
# overlong forms (E0 80-9F, F0 80-8F), UTF-16 surrogates (ED A0-BF) and code points past
# U+10FFFF (F4 90-BF). Detokenized, such bytes become replacement characters, which
# break a string's length limits and the text itself.
_BAD_SECOND_BYTE = {0xE0: (0x80, 0x9F), 0xED: (0xA0, 0xBF), 0xF0: (0x80, 0x8F), 0xF4: (0x90, 0xBF)}
_BAD_PAIR = re.compile(b"|".join(bytes([lead]) + b"[" + bytes([low]) + b"-" + bytes([high]) + b"]"
                                 for lead, (low, high) in _BAD_SECOND_BYTE.items()))


@dataclass(frozen=True)
class Utf8Guard:
    """The tokens that would make the output invalid UTF-8 although xgrammar allows them:
    a bad lead/second-byte pair inside one token, or split across two."""

    #: tokens with a bad pair inside them: never allowed
    inside: Any
    #: per lead byte, the tokens whose first byte may not follow it
    continuation: dict[int, Any]
    #: token id -> its last byte, for tokens that end in one of those lead bytes
    trailing_lead: dict[int, int]

    @classmethod
    def of(cls, decoded_vocab: Sequence[bytes], vocab_size: int) -> Utf8Guard:
        inside: list[int] = []
        starts: dict[int, list[int]] = {lead: [] for lead in _BAD_SECOND_BYTE}
        trailing: dict[int, int] = {}
        for token_id, raw in enumerate(decoded_vocab[:vocab_size]):
            if not raw:
                continue
            if _BAD_PAIR.search(raw):
                inside.append(token_id)
            for lead, (low, high) in _BAD_SECOND_BYTE.items():
                if low <= raw[0] <= high:
                    starts[lead].append(token_id)
            if raw[-1] in _BAD_SECOND_BYTE:
                trailing[token_id] = raw[-1]
        return cls(bitmask_of(inside, vocab_size),
                   {lead: bitmask_of(ids, vocab_size) for lead, ids in starts.items()}, trailing)

    def after(self, token_id: int) -> Any:
        """The tokens that may not follow ``token_id`` (None: no restriction)."""
        lead = self.trailing_lead.get(token_id)
        return None if lead is None else self.continuation[lead]


@dataclass
class CompilerStats:
    """Counters of a :class:`GrammarCompilerCache` since it was built."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    timeouts: int = 0
    errors: int = 0
    compile_seconds_total: float = 0.0


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of ``tokenizer``'s special tokens (control tokens such as ``<|im_start|>``)."""
    hf = hf_tokenizer(tokenizer)
    ids = {int(i) for i in (getattr(hf, "all_special_ids", None) or [])}
    for token_id, added in (getattr(hf, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def special_tokens(tokenizer: Any) -> set[str]:
    """The text of ``tokenizer``'s special tokens."""
    hf = hf_tokenizer(tokenizer)
    return {hf.convert_ids_to_tokens(i) for i in special_token_ids(tokenizer)}


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int | None,
                    stop_token_ids: Sequence[int] | None) -> Any:
    hf = hf_tokenizer(tokenizer)
    if stop_token_ids is None:
        # mlx-lm's wrapper holds a set of EOS ids; a Hugging Face tokenizer one int or none.
        eos = getattr(tokenizer, "eos_token_ids", None)
        if eos is None:
            eos = getattr(hf, "eos_token_id", None)
        stop_token_ids = [eos] if isinstance(eos, int) else sorted(eos or [])
    return xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)


def json_safe_strings(schema: Any) -> Any:
    """``schema`` with each length-bounded string turned into the equivalent ``pattern``.

    xgrammar 0.2.8 compiles ``minLength``/``maxLength`` strings to a character class that
    admits raw control characters (a tab, \\x12), which JSON forbids inside strings: the
    output would not parse. A pattern over the characters that need no escape keeps the
    bounds and the validity (such strings cannot contain escapes then).
    """
    if isinstance(schema, list):
        return [json_safe_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    patched = {key: json_safe_strings(value) for key, value in schema.items()}
    is_string = patched.get("type") == "string"
    bounded = "minLength" in patched or "maxLength" in patched
    if is_string and bounded and not ({"pattern", "format", "enum", "const"} & patched.keys()):
        low = int(patched.pop("minLength", 0))
        high = patched.pop("maxLength", None)
        patched["pattern"] = r'^[^"\\\x00-\x1f]{%d,%s}$' % (low, "" if high is None else int(high))
    return patched


class GrammarCompilerCache:
    """Compiles grammars for one tokenizer and keeps the most recently used, up to
    ``cache_bytes`` of compiled grammars.

    ``vocab_size`` is the model's logits width, which can exceed the tokenizer's
    vocabulary (padded embeddings); masks are that wide. ``stop_token_ids`` are the
    tokens that end a constrained output (default: the tokenizer's EOS ids).
    ``compile_timeout_s`` overrides the compile queue's time limit for this cache.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int | None = None,
                 stop_token_ids: Sequence[int] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES,
                 compile_timeout_s: float | None = None) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must not be negative, got {cache_bytes}")
        if compile_timeout_s is not None and compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be positive, got {compile_timeout_s}")
        self._xgr = import_xgrammar()
        self.tokenizer_info = _tokenizer_info(self._xgr, tokenizer, vocab_size, stop_token_ids)
        self.vocab_size: int = self.tokenizer_info.vocab_size
        self.stop_token_ids: list[int] = list(self.tokenizer_info.stop_token_ids)
        # Structural tags name marker tokens by text; resolving them here gives an unknown
        # name an error that lists the tokens this model has.
        hf = hf_tokenizer(tokenizer)
        self._special_ids = {hf.convert_ids_to_tokens(i): i for i in special_token_ids(tokenizer)}
        # xgrammar reads control tokens (<|im_start|>, <|endoftext|>) as their literal
        # text, so free text and JSON strings could contain them; masks leave them out
        # unless the grammar names them (a tool-call marker). Stop tokens end the grammar.
        self._control_ids = frozenset(i for i in self._special_ids.values()
                                      if i not in self.stop_token_ids and i < self.vocab_size)
        self.utf8_guard = Utf8Guard.of(self.tokenizer_info.decoded_vocab, self.vocab_size)
        self.cache_bytes = cache_bytes
        self.compile_timeout_s = compile_timeout_s
        #: this tokenizer's name in the compile workers
        self.key = uuid.uuid4().hex
        self._serialized_info: str | None = None
        # xgrammar's own cache is off: this one is the bound on compiled-grammar memory.
        self._compiler = self._xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, tuple[Any, float, Any, int]] = OrderedDict()
        self.bytes = 0
        # Compiles under way, shared by concurrent requests for the same grammar, so a
        # grammar is never compiled twice at once.
        self._inflight: dict[tuple, Future] = {}
        self.stats = CompilerStats()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec.key in self._entries

    def close(self) -> None:
        """Drop the compiled grammars (the compile workers are the process's)."""
        self.release(dry_run=False)

    def release(self, dry_run: bool) -> int:
        """The bytes of the compiled grammars kept; unless ``dry_run``, dropped and their
        memory handed back to the OS (a grammar a running request still holds goes with
        that request)."""
        with self._lock:
            held = self.bytes
            if not dry_run:
                self._entries.clear()
                self.bytes = 0
        if not dry_run and held:
            trim_heap()
        return held

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> Compiled:
        """The compiled form of ``spec``, from the cache or compiled now.

        Raises :class:`GrammarError` (naming ``spec.field``) when the grammar is invalid or
        unsupported, :class:`GrammarCompileTimeout` when compiling takes longer than
        ``timeout_s`` (default: the cache's, else the queue's limit) or more memory than
        the queue allows (the compile is stopped), :class:`GrammarBusy` when the compile
        queue has no room for it now.
        """
        key = spec.key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return Compiled(spec, entry[0], entry[1], True, self.vocab_size, entry[2],
                                self.utf8_guard)
            self.stats.misses += 1
            shared = self._inflight.get(key)
            # The first asker compiles; the others wait for its result. (Deciding it with
            # the future's own state outside the lock raised for every second asker:
            # set_running_or_notify_cancel on a running future is an error, a 500.)
            compiles_it = shared is None
            if compiles_it:
                shared = self._inflight[key] = Future()
        if compiles_it:
            try:
                entry = self._compile_now(spec, timeout_s)
            except BaseException as exc:
                self._finish(key, shared, exception=exc)
                raise
            self._finish(key, shared, entry=entry)
            return Compiled(spec, entry[0], entry[1], False, self.vocab_size, entry[2],
                            self.utf8_guard)
        grammar, seconds, forbidden, _size = shared.result()
        return Compiled(spec, grammar, seconds, False, self.vocab_size, forbidden, self.utf8_guard)

    def _finish(self, key: tuple, shared: Future, *, entry: tuple | None = None,
                exception: BaseException | None = None) -> None:
        evicted = 0
        with self._lock:
            self._inflight.pop(key, None)
            if exception is not None:
                if isinstance(exception, GrammarCompileTimeout):
                    self.stats.timeouts += 1
                elif isinstance(exception, GrammarError):
                    self.stats.errors += 1
            elif entry is not None:
                evicted = self._keep(key, entry)
        if evicted:
            # The heap keeps freed pages resident until trimmed: what an eviction freed
            # would stay in the footprint, where the guard counts it as in use.
            trim_heap()
        if exception is not None:
            shared.set_exception(exception)
        else:
            shared.set_result(entry)

    def _keep(self, key: tuple, entry: tuple[Any, float, Any, int]) -> int:
        """Cache ``entry`` and evict the least recently used past the byte budget (the
        lock is held); the number evicted."""
        self.stats.compile_seconds_total += entry[1]
        size = entry[3]
        if size > self.cache_bytes:
            return 0  # larger than the whole budget: used once, not kept
        self._entries[key] = entry
        self.bytes += size
        evicted = 0
        while self.bytes > self.cache_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped[3]
            self.stats.evictions += 1
            evicted += 1
        return evicted

    def _compile_now(self, spec: GrammarSpec, timeout_s: float | None) -> tuple[Any, float, Any, int]:
        request = self._worker_request(spec)
        job = CompileJob(self.key, self._tokenizer_payload, request, spec.field,
                         build=lambda: compile_request(self._compiler, request),
                         timeout_s=timeout_s if timeout_s is not None else self.compile_timeout_s,
                         client=compile_client.get())
        future = compile_queue().submit(job)
        try:
            grammar, output = future.result()
        except CompileFailed as failed:
            raise GrammarError(spec.field, _describe_failure(spec, failed)) from None
        forbidden = self._forbidden_bitmask(spec)
        size = int(grammar.memory_size_bytes) + (forbidden.nbytes if forbidden is not None else 0)
        return grammar, output.seconds, forbidden, size

    def _tokenizer_payload(self) -> str:
        if self._serialized_info is None:
            self._serialized_info = self.tokenizer_info.serialize_json()
        return self._serialized_info

    def _worker_request(self, spec: GrammarSpec) -> dict[str, Any]:
        """What a worker compiles for ``spec``: the source xgrammar takes, after the
        workarounds that need this tokenizer (token names resolved here)."""
        if spec.kind == "json_schema":
            return {"kind": "json_schema", "source": json.dumps(json_safe_strings(json.loads(spec.text))),
                    "strict": spec.strict, "max_whitespace": spec.max_whitespace}
        if spec.kind == "any_json":
            return {"kind": "json_schema", "source": ANY_JSON_SCHEMA, "strict": False,
                    "max_whitespace": spec.max_whitespace}
        if spec.kind in ("regex", "ebnf"):
            return {"kind": spec.kind, "source": spec.text}
        if spec.kind == "structural_tag":
            tag = _token_names_to_ids(json_safe_strings(json.loads(spec.text)), self._special_ids,
                                      spec.field)
            return {"kind": "structural_tag", "source": json.dumps(tag)}
        raise GrammarError(spec.field, f"unknown grammar kind {spec.kind!r}; use one of {', '.join(KINDS)}")

    def _forbidden_bitmask(self, spec: GrammarSpec) -> Any:
        import numpy as np

        named: set[int] = set()
        if spec.kind == "structural_tag":
            _collect_tokens(json.loads(spec.text), self._special_ids, named)
        mask = bitmask_of(self._control_ids - named, self.vocab_size)
        np.bitwise_or(mask, self.utf8_guard.inside, out=mask)
        return mask if mask.any() else None

    def describe(self) -> str:
        return (f"{len(self)} compiled grammars, {format_size(self.bytes)} of "
                f"{format_size(self.cache_bytes)}")


def _token_names_to_ids(value: Any, ids: dict[str, int], field: str) -> Any:
    def resolve(token: Any) -> Any:
        if not isinstance(token, str):
            return token
        if token not in ids:
            raise GrammarError(field, f"names the token {token!r}, which is not a special token of "
                               f"this model's tokenizer (its special tokens: {', '.join(sorted(ids))})")
        return ids[token]

    if isinstance(value, list):
        return [_token_names_to_ids(item, ids, field) for item in value]
    if not isinstance(value, dict):
        return value
    resolved = {key: _token_names_to_ids(item, ids, field) for key, item in value.items()}
    if resolved.get("type") == "token":
        resolved["token"] = resolve(resolved.get("token"))
    for key in ("trigger_tokens", "exclude_tokens"):
        if isinstance(resolved.get(key), list):
            resolved[key] = [resolve(token) for token in resolved[key]]
    return resolved


def _collect_tokens(value: Any, ids: dict[str, int], into: set[int]) -> None:
    if isinstance(value, list):
        for item in value:
            _collect_tokens(item, ids, into)
    elif isinstance(value, dict):
        if value.get("type") == "token":
            token = value.get("token")
            into.add(ids.get(token, -1) if isinstance(token, str) else int(token))
        for token in value.get("trigger_tokens") or ():
            into.add(ids.get(token, -1) if isinstance(token, str) else int(token))
        for item in value.values():
            _collect_tokens(item, ids, into)


# xgrammar prefixes its C++ errors with a timestamp and a source location
# ("[11:14:50] /project/cpp/regex_converter.cc:83: "), which mean nothing to a client.
_CPP_LOCATION = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _describe_failure(spec: GrammarSpec, exc: Exception) -> str:
    reason = str(exc).strip().splitlines()
    detail = _CPP_LOCATION.sub("", reason[0]) if reason else type(exc).__name__
    what = {
        "json_schema": "is not a JSON Schema xgrammar supports",
        "any_json": "could not be compiled",
        "regex": "is not a regular expression xgrammar supports",
        "ebnf": "is not a valid EBNF grammar (llama.cpp GBNF syntax with a `root` rule)",
        "structural_tag": "is not a valid structural tag",
    }[spec.kind]
    return f"{what}: {detail}"


_per_tokenizer: weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCompilerCache]] = weakref.WeakKeyDictionary()
_per_tokenizer_lock = threading.Lock()


_cache_bytes = DEFAULT_CACHE_BYTES


def configure_cache_bytes(nbytes: int) -> None:
    """The byte budget of every compiled-grammar cache built from now on
    (``grammar.cache_size``)."""
    global _cache_bytes
    _cache_bytes = int(nbytes)


def compiled_grammar_bytes(dry_run: bool = True) -> int:
    """Bytes of compiled grammars every cache of this process keeps; unless ``dry_run``,
    dropped (the memory guard reclaiming room: they are compiled again when asked for)."""
    with _per_tokenizer_lock:
        caches = [cache for per_key in list(_per_tokenizer.values()) for cache in per_key.values()]
    return sum(cache.release(dry_run) for cache in caches)


register_reclaimable(compiled_grammar_bytes)


def compiler_for(tokenizer: Any, *, vocab_size: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, **kwargs: Any) -> GrammarCompilerCache:
    """The process's :class:`GrammarCompilerCache` for ``tokenizer`` (an mlx-lm
    ``TokenizerWrapper`` or a Hugging Face tokenizer), built on first use and dropped with
    the tokenizer. ``kwargs`` (cache_bytes, compile_timeout_s) apply when it is built."""
    key = (vocab_size, tuple(stop_token_ids) if stop_token_ids is not None else None)
    with _per_tokenizer_lock:
        caches = _per_tokenizer.setdefault(tokenizer, {})
        cache = caches.get(key)
        if cache is None:
            cache = GrammarCompilerCache(tokenizer, vocab_size=vocab_size,
                                         stop_token_ids=stop_token_ids,
                                         **{"cache_bytes": _cache_bytes, **kwargs})
            caches[key] = cache
        return cache
