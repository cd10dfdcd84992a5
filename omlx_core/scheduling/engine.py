"""The ``batched`` engine: one model, continuous batching, served from the MLX thread."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import platform
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Mapping, Sequence

from omlx_core.engine import (
    OPTIONAL_SAMPLING,
    EngineLimits,
    GenerationOutput,
    GenerationRequest,
    GuardedEngine,
    MemoryHints,
    QueuedRequestHandle,
    RequestProgress,
)
from omlx_core.models.errors import ModelError
from omlx_core.scheduling.decode_batch import warm_up
from omlx_core.scheduling.kv_cache import KVFormat, check_kv_format, make_request_cache, quantized_layers
from omlx_core.scheduling.prefix_cache import PrefixCache
from omlx_core.scheduling.sampling import check_sampling
from omlx_core.scheduling.scheduler import Scheduler, SequenceState, new_sequence
from omlx_core.scheduling.speculation import PromptLookupDrafts

if TYPE_CHECKING:
    from omlx_core.host import EngineHost
    from omlx_core.models.registry import ModelSpec

log = logging.getLogger(__name__)

#: what :meth:`BatchedEngine.cache_points` puts as a partial conversation's next message
#: (a private-use character: no template writes one of its own)
_CONTENT_MARK = "\ue000"

#: (model path, KV format) pairs whose :func:`~.decode_batch.warm_up` ran in this process
_warmed: set[tuple[str, str]] = set()
_warmed_lock = threading.Lock()


@dataclass(frozen=True)
class EngineSettings:
    """The configuration keys the batched engine reads."""

    max_batch_size: int = 16
    prefill_step_size: int = 512
    block_size: int = 64
    cache_budget: int = 1 << 30
    batch_window_s: float = 0.01
    batch_window_max_s: float = 0.1
    speculation: bool = True
    max_draft_tokens: int = 6
    max_decode_gap_ms: float = 250.0

    @classmethod
    def from_config(cls, config: Any) -> "EngineSettings":
        return cls(
            max_batch_size=int(config["plugin.batched.max_batch_size"]),
            prefill_step_size=int(config["plugin.batched.prefill_step_size"]),
            block_size=int(config["plugin.batched.block_size"]),
            cache_budget=int(config["plugin.batched.prefix_cache_budget"]),
            batch_window_s=float(config["plugin.batched.batch_window_s"]),
            batch_window_max_s=float(config["plugin.batched.batch_window_max_s"]),
            speculation=bool(config["plugin.batched.speculation"]),
            max_draft_tokens=int(config["plugin.batched.max_draft_tokens"]),
            max_decode_gap_ms=float(config["plugin.batched.max_decode_gap_ms"]),
        )


def kv_format_of(host: EngineHost) -> KVFormat:
    """The KV format of the host's model: its ``[models.<id>] kv_bits`` and
    ``kv_group_size`` over ``engine.kv_bits`` and ``engine.kv_group_size``."""
    return KVFormat.from_settings(host.model_setting("kv_bits", "engine.kv_bits"),
                                  host.model_setting("kv_group_size", "engine.kv_group_size"))


def create_prefix_cache(model: ModelSpec, host: EngineHost) -> PrefixCache:
    """The in-memory prefix cache for ``model``, the first of the host's lower cache
    tiers behind it."""
    settings = EngineSettings.from_config(host.config)
    kv_format = kv_format_of(host)
    try:
        kv_format.check_block_size(settings.block_size)
    except ValueError as exc:
        raise ModelError(f"model {model.id!r}: {exc}") from None
    # Blocks of another KV format never match: the format is part of every block's key.
    namespace = f"{model.id}\0{model.path}"
    if kv_format.quantized:
        namespace += f"\0{kv_format.tag}"
    cache = PrefixCache(settings.block_size, settings.cache_budget, namespace=namespace)
    if host.lower_tiers:
        if len(host.lower_tiers) > 1:
            log.warning("model %r: %d lower cache tiers; the prefix cache uses the first",
                        model.id, len(host.lower_tiers))
        cache.attach_lower(host.lower_tiers[0])
        if not cache.enabled:
            log.warning("model %r: plugin.batched.prefix_cache_budget is 0, so the prefix cache "
                        "is off and the cache tier behind it is never used; set "
                        "plugin.batched.prefix_cache_budget above 0 to use it", model.id)
    return cache


def _model_context_length(config: Mapping[str, Any]) -> int | None:
    for table in (config, config.get("text_config") or {}):
        value = table.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def _trim_malloc_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc only; a no-op elsewhere).

    Freed weights below glibc's mmap threshold stay in its arenas, resident, until
    trimmed; the memory guard reads the process footprint and would count them.
    """
    if platform.system() != "Linux":
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        pass


class BatchedEngine(GuardedEngine):
    """Serves one mlx-lm model with continuous batching, chunked prefill and a prefix cache.

    Its memory receiver (``resolve_scheduler``) is its :class:`~.scheduler.Scheduler`.
    """

    supported_sampling = OPTIONAL_SAMPLING

    def __init__(self, model: ModelSpec, host: EngineHost, *,
                 loaded: tuple[Any, Any] | None = None) -> None:
        super().__init__(model, host)
        #: ``(model, tokenizer)`` another engine already loaded: served without a second
        #: copy of the weights (a speculative engine's fallback path)
        self._preloaded = loaded
        self.config = host.config
        self.settings = EngineSettings.from_config(host.config)
        #: the KV cache format of the model's plain attention layers (its own
        #: ``[models.<id>] kv_bits`` over ``engine.kv_bits``)
        self.kv_format = kv_format_of(host)
        self.prefix_cache = create_prefix_cache(model, host)
        self.scheduler: Scheduler | None = None
        self.tokenizer: Any = None
        self.vocab_size = 0
        self._lm: Any = None
        #: bytes per activation element of the loaded model (None until started)
        self.activation_dtype_bytes: int | None = None
        #: (quantized, unquantized) cache layers of the loaded model
        self.kv_layers: tuple[int, int] = (0, 0)
        self._thread = host.thread
        self._tokenizer_lock = threading.Lock()
        self._start_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        with self._start_lock:
            if self.scheduler is not None:
                return
            self.scheduler = self._thread.run(self._load)
            self._thread.run(self._warm_up)
            self._thread.attach(self.scheduler)

    def _load(self) -> Scheduler:
        from omlx_core.models.loader import load_model

        self.adopt(*(self._preloaded or load_model(self.model.path)))
        lm, tokenizer = self._lm, self.tokenizer
        return Scheduler(
            model=lm, tokenizer=tokenizer, model_id=self.model.id, model_config=self.model.config,
            vocab_size=self.vocab_size, max_batch_size=self.settings.max_batch_size,
            prefill_step_size=self.settings.prefill_step_size, prefix_cache=self.prefix_cache,
            batch_window_s=self.settings.batch_window_s,
            batch_window_max_s=self.settings.batch_window_max_s,
            drafts=(PromptLookupDrafts(max_drafts=self.settings.max_draft_tokens)
                    if self.settings.speculation else None),
            max_decode_gap_s=self.settings.max_decode_gap_ms / 1000.0,
            wake=self._thread.wake, boundary_listener=self.host.on_boundary_snapshot,
            finish_listener=self.host.on_request_finished, kv_format=self.kv_format,
        )

    def _warm_up(self) -> None:
        """Pay what a first request would pay once, before the engine serves:
        :func:`~.decode_batch.warm_up` (once per model and KV format in this process: a
        model the pool loads again finds its routes, kernels and BLAS threads started,
        and its weights are evaluated at load; a float16 model's warm-up forwards alone
        took ~4 s of a 2-core machine at every reload), and the chat template's first
        rendering (the tokenizer is new at every load)."""
        warmed = (str(self.model.path), str(self.kv_format))
        with _warmed_lock:
            first = warmed not in _warmed
        if first:
            warm_up(self._lm, lambda: make_request_cache(self._lm, self.kv_format))
            with _warmed_lock:
                _warmed.add(warmed)
        if getattr(self.tokenizer, "chat_template", None):
            try:
                self.tokenize_chat([{"role": "user", "content": "Hello"}])
            except Exception:  # a template that wants more than one message: warm it at use
                log.debug("chat template of %r not warmed up", self.model.id, exc_info=True)
        self.detokenizer().add_token(0)

    def adopt(self, lm: Any, tokenizer: Any) -> None:
        """Serve the loaded ``lm`` and ``tokenizer`` (on the MLX thread, while starting):
        check that its cache takes the KV format, and read its dtype and vocabulary.

        :raises ModelError: the model cannot be served with :attr:`kv_format`.
        """
        from omlx_core.models.loader import activation_dtype_bytes

        try:
            check_kv_format(lm, self.kv_format, self.model.id)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        self._lm, self.tokenizer = lm, tokenizer
        self.activation_dtype_bytes = activation_dtype_bytes(lm)
        self.kv_layers = quantized_layers(lm, self.kv_format)
        args = getattr(lm, "args", None)
        self.vocab_size = int(getattr(args, "vocab_size", 0) or self.model.config.get("vocab_size")
                              or len(tokenizer))

    def shutdown(self) -> None:
        with self._start_lock:
            scheduler, self.scheduler = self.scheduler, None
            if scheduler is None:
                return
            self._thread.run(scheduler.shutdown)
            self._thread.detach(scheduler)
            del scheduler
            self._thread.run(self._release)

    def _release(self) -> None:
        import gc

        import mlx.core as mx

        self._lm = None
        self._preloaded = None
        self.prefix_cache.clear()
        # Freed buffers go to mlx's buffer cache, which still counts in the process's
        # resident memory: collect the last references first, then empty that cache.
        gc.collect()
        mx.clear_cache()
        _trim_malloc_heap()

    # -- what the pipeline and the memory guard ask -------------------------------------

    def limits(self) -> EngineLimits:
        self._require_started()
        return EngineLimits(context_length=_model_context_length(self.model.config),
                            vocab_size=self.vocab_size, max_running=self.settings.max_batch_size)

    def memory_hints(self) -> MemoryHints:
        # Prefill forwards evaluate only the cache (the last prompt token's logits come
        # from a one-position forward); a reused prefix is copied into the request's own
        # cache; the decode batch is mlx-lm's left-padded BatchGenerator.
        return MemoryHints(prefill_step_size=self.settings.prefill_step_size,
                           activation_dtype_bytes=self.activation_dtype_bytes or 4,
                           prefill_full_logits=False, cached_kv_resident=False,
                           decode_batch_padded=True, kv_bits=self.kv_format.bits,
                           kv_group_size=self.kv_format.group_size)

    def reclaimable_bytes(self) -> int:
        return self.prefix_cache.reclaimable_bytes()

    def reclaim(self, nbytes: int) -> int:
        # Evicted blocks go to a lower tier (a host copy), which is MLX-thread work.
        return self._thread.run(self.prefix_cache.release, nbytes)

    # -- tokenization ----------------------------------------------------------------

    def _require_started(self) -> Scheduler:
        scheduler = self.scheduler
        if scheduler is None:
            raise RuntimeError(f"engine for model {self.model.id!r} is not started; call start() first")
        return scheduler

    def chat_template(self) -> str | None:
        self._require_started()
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def special_tokens(self) -> frozenset[str]:
        from omlx_core.grammar import special_tokens

        self._require_started()
        return frozenset(special_tokens(self.tokenizer))

    def detokenizer(self) -> Any:
        self._require_started()
        return self.tokenizer.detokenizer

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        self._require_started()
        with self._tokenizer_lock:
            return list(self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True,
                **template_kwargs))

    def cache_points(self, messages: Sequence[Mapping[str, Any]], prompt_tokens: Sequence[int],
                     **template_kwargs: Any) -> tuple[int, ...]:
        """For a model with layers resumed only where their state was kept (recurrent,
        sliding-window): the end of the leading system messages and the start of the
        last message. Requests that share a system prompt part at the first; a
        conversation re-sent with its last message changed (edited, retried, a tool
        result cut) at the second. Prefill ends a chunk at each and keeps the state there
        (:meth:`PrefillPlanner.plan`).

        Each is found in text: where the conversation rendered up to there, with a marker
        as the next message, shows the marker. Only the shorter side of that cut is
        tokenized again (the last message, or the system prompt), and the cut counts only
        where the prompt's own tokens split there too."""
        scheduler = self._require_started()
        if (not self.prefix_cache.enabled or not scheduler.layout.needs_boundaries
                or len(messages) < 2 or template_kwargs.get("images") is not None):
            return ()  # (a prompt with images is not the template's tokens alone)
        system = next((i for i, m in enumerate(messages)
                       if m.get("role") not in ("system", "developer")), len(messages))
        partials = [list(messages[:-1]) + [{"role": messages[-1].get("role") or "user",
                                            "content": _CONTENT_MARK}]]
        if 0 < system < len(messages) - 1:
            partials.insert(0, list(messages[:system]) + [{"role": "user", "content": _CONTENT_MARK}])
        with self._tokenizer_lock:
            full = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=False,
                **template_kwargs)
        points: list[int] = []
        for partial in partials:
            try:
                point = self._point_at_mark(full, partial, prompt_tokens, template_kwargs)
            except Exception:  # noqa: BLE001 - a template that rejects this partial: no point here
                log.debug("no cache point for a partial conversation of %d messages", len(partial),
                          exc_info=True)
                continue
            if point is not None and 0 < point < len(prompt_tokens) - 1 and point not in points:
                points.append(point)
        return tuple(sorted(points))

    def _point_at_mark(self, full: str, partial: list[Mapping[str, Any]], prompt_tokens: Sequence[int],
                       template_kwargs: Mapping[str, Any]) -> int | None:
        """The token index in ``prompt_tokens`` (``full`` as text) where ``partial``'s
        rendering shows :data:`_CONTENT_MARK`, if the two texts agree up to there and the
        prompt's tokens split there."""
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in partial], add_generation_prompt=False, tokenize=False,
                **template_kwargs)
        chars = text.find(_CONTENT_MARK)
        if chars <= 0 or not full.startswith(text[:chars]):
            return None
        with self._tokenizer_lock:
            if chars <= len(full) - chars:
                head = list(self.tokenizer.encode(full[:chars], add_special_tokens=False))
                return len(head) if list(prompt_tokens[:len(head)]) == head else None
            tail = list(self.tokenizer.encode(full[chars:], add_special_tokens=False))
        cut = len(prompt_tokens) - len(tail)
        return cut if cut > 0 and list(prompt_tokens[cut:]) == tail else None

    def tokenize(self, text: str) -> list[int]:
        self._require_started()
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text))

    # -- requests --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> QueuedRequestHandle:
        """Queue ``request`` (checked against :meth:`limits` by the pipeline); raises
        ``ValueError`` naming what makes it unservable."""
        scheduler = self._require_started()
        if len(request.prompt_tokens) == 0:
            raise ValueError("prompt_tokens is empty; a request needs at least one prompt token")
        check_sampling(request.sampling)
        sequence = self._new_sequence(request)
        self.constrain(sequence)
        handle = QueuedRequestHandle(request.request_id, sequence.outputs, self.abort)
        scheduler.enqueue(sequence)
        return handle

    def constrain(self, sequence: SequenceState) -> None:
        """Compile the grammar ``sequence``'s request names, if any, into its constraint.

        Called on the request's thread (bounded in time), not on the MLX thread; an
        unusable grammar raises ``GrammarError`` (HTTP 400 naming its field)."""
        grammar = sequence.request.sampling.grammar
        if grammar is None:
            return
        from omlx_core.grammar import GrammarConstraint, compiler_for

        compiled = compiler_for(self.tokenizer, vocab_size=self.vocab_size).compile(grammar)
        sequence.grammar = GrammarConstraint(compiled)

    def _new_sequence(self, request: GenerationRequest) -> Any:
        """The scheduler state of a validated ``request``."""
        return new_sequence(request)

    def abort(self, request_id: str) -> None:
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.abort(request_id)

    def expecting(self) -> ContextManager[None]:
        scheduler = self.scheduler
        return scheduler.expecting() if scheduler is not None else contextlib.nullcontext()

    def cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        if not self.prefix_cache.enabled or len(prompt_tokens) < 2:
            return 0
        prefix = list(prompt_tokens[:-1])
        scheduler = self.scheduler
        layout = scheduler.layout if scheduler is not None else None
        return self.prefix_cache.peek_prefix(self.prefix_cache.hashes(prefix), prefix,
                                             needs_boundaries=layout is not None and layout.needs_boundaries)

    def stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        if scheduler is None:
            return {"model": self.model.id, "started": False}
        return {"model": self.model.id, "started": True, "kv_cache": self.kv_cache_format(),
                **scheduler.stats()}


    def kv_cache_format(self) -> str:
        """The KV cache's format in words, e.g. ``"8-bit (group 64); 6 sliding-window or
        recurrent layers at 4-byte activations"`` (``/health``, ``ps``, the dashboard)."""
        activation = f"{self.activation_dtype_bytes or 4}-byte activations"
        described = self.kv_format.describe(f"unquantized ({activation})")
        quantized, kept = self.kv_layers
        if quantized and kept:
            described += (f"; {kept} sliding-window or recurrent layers unquantized "
                          "(mlx-lm has no quantized form of them)")
        return described

    def progress(self) -> list[RequestProgress]:
        scheduler = self.scheduler
        return scheduler.progress() if scheduler is not None else []
