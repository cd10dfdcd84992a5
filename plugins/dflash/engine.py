"""The ``dflash`` engine: speculative decoding for a lone request, batching for the rest.

One model is loaded once. A request that arrives while the primary (speculative) path
is idle, and that the path can serve, is decoded there (:mod:`.speculative`); every
other request goes to a batched engine built over the same loaded weights (no second
copy of the target): requests that arrive while a speculative one runs, and ones the
primary path cannot serve (penalties, ``logit_bias``, logprobs, a grammar; a prompt
and ``max_tokens`` past the drafter's window).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from omlx_core.engine import (
    OPTIONAL_SAMPLING,
    EngineLimits,
    GenerationRequest,
    GuardedEngine,
    MemoryHints,
    RequestHandle,
    RequestProgress,
)
from omlx_core.scheduling import ModelError
from omlx_core.scheduling import BatchedEngine
from omlx_core.scheduling import check_sampling
from omlx_core.scheduling import Drafter, NgramDrafter
from omlx_core.plugins.dflash.drafters import ModelDrafter
from omlx_core.plugins.dflash.memory import BothPaths, PrimaryPathGuard, speculative_extra_bytes
from omlx_core.plugins.dflash.rollback import unsupported_layers
from omlx_core.plugins.dflash.speculative import PrimaryPath, SpeculativeRequestHandle

if TYPE_CHECKING:
    from omlx_core.host import EngineHost
    from omlx_core.scheduling import PeakQuery
    from omlx_core.scheduling import ModelSpec

log = logging.getLogger(__name__)

DRAFTERS = ("ngram", "model", "dflash")


@dataclass(frozen=True)
class DFlashSettings:
    """The ``[plugin.dflash]`` keys, with a model's own ``[models.<id>]`` choices over them."""

    drafter: str = "ngram"
    draft_path: str = ""
    block_size: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    draft_token_cost: float = 0.1

    @classmethod
    def for_model(cls, host: EngineHost) -> "DFlashSettings":
        config = host.config
        return cls(drafter=str(host.model_setting("drafter", "plugin.dflash.drafter")),
                   draft_path=str(host.model_setting("draft_path", "plugin.dflash.draft_path") or ""),
                   block_size=int(config["plugin.dflash.block_size"]),
                   ngram_min=int(config["plugin.dflash.ngram_min"]),
                   ngram_max=int(config["plugin.dflash.ngram_max"]),
                   draft_token_cost=float(config["plugin.dflash.draft_token_cost"]))

    def make_drafter(self, model: ModelSpec) -> Drafter:
        if self.drafter == "ngram":
            return NgramDrafter(block_size=self.block_size or 8, ngram_min=self.ngram_min,
                                ngram_max=self.ngram_max, token_cost=self.draft_token_cost)
        if self.drafter not in DRAFTERS:
            raise ModelError(f"model {model.id!r}: unknown drafter {self.drafter!r}; use one of "
                             + ", ".join(DRAFTERS))
        path = _draft_dir(model, self.drafter, self.draft_path)
        if self.drafter == "model":
            return ModelDrafter(path, block_size=self.block_size or 5)
        try:
            from omlx_core.plugins.dflash.block_diffusion import DFlashDrafter
        except ImportError as exc:
            raise ModelError(f"model {model.id!r}: the 'dflash' drafter needs z-lab's dflash "
                             f"package ({exc}); install it with "
                             "`pip install --no-deps dflash==0.1.0` (setup.sh does)") from None
        return DFlashDrafter(path, block_size=self.block_size or None)


def _draft_dir(model: ModelSpec, drafter: str, draft_path: str) -> Path:
    if not draft_path:
        raise ModelError(f"model {model.id!r}: the {drafter!r} drafter needs draft weights; set "
                         f"draft_path in [models.{model.id}] or plugin.dflash.draft_path to a local "
                         "directory, or a Hugging Face repo id already in the local cache")
    path = Path(draft_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(draft_path, local_files_only=True))
    except Exception:
        raise ModelError(f"model {model.id!r}: draft_path {draft_path!r} is neither a local "
                         "directory nor a repo in the local Hugging Face cache (drafts are never "
                         "downloaded); download it first or point draft_path at a directory"
                         ) from None


#: started engines by model id, for the plugin's ``estimate_peak`` wrapper
_ENGINES: dict[str, "DFlashEngine"] = {}
_ENGINES_LOCK = threading.Lock()


def engine_for_model(model_id: str) -> "DFlashEngine | None":
    with _ENGINES_LOCK:
        return _ENGINES.get(model_id)


class DFlashEngine(GuardedEngine):
    """Speculative decoding on the primary path, a batched engine as fallback.

    Its memory receiver (``resolve_scheduler``) is :class:`~.memory.BothPaths`.
    """

    supported_sampling = OPTIONAL_SAMPLING

    def __init__(self, model: ModelSpec, host: EngineHost, *, drafter: Drafter | None = None) -> None:
        super().__init__(model, host)
        self.settings = DFlashSettings.for_model(host)
        self.drafter = drafter if drafter is not None else self.settings.make_drafter(model)
        self.prefill_step_size = int(host.config["plugin.batched.prefill_step_size"])
        self._thread = host.thread
        self.guard = PrimaryPathGuard()
        self.fallback: BatchedEngine | None = None
        self.primary: PrimaryPath | None = None
        self.receiver: BothPaths | None = None
        #: why the primary path is off for this model (``None``: it is on)
        self.speculation_off: str | None = None
        self.fallback_requests = 0
        self._start_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        with self._start_lock:
            if self.fallback is not None:
                return
            lm, tokenizer = self._thread.run(self._load)
            # Over the same host: the fallback reports to the same sinks and keeps the
            # host's lower cache tiers behind its prefix cache.
            fallback = BatchedEngine(self.model, self.host, loaded=(lm, tokenizer))
            fallback.start()
            self.fallback = fallback
            self.receiver = BothPaths(self.guard, fallback.scheduler)
            self.primary = PrimaryPath(
                model=lm, tokenizer=tokenizer, model_id=self.model.id,
                model_config=self.model.config, drafter=self.drafter, guard=self.guard,
                prefill_step_size=self.prefill_step_size,
                on_finished=self.host.on_request_finished)
            self._thread.attach(self.primary)
            with _ENGINES_LOCK:
                _ENGINES[self.model.id] = self

    def _load(self) -> tuple[Any, Any]:
        from mlx_lm.models.cache import make_prompt_cache

        from omlx_core.scheduling import load_model

        lm, tokenizer = load_model(self.model.path)
        unsupported = unsupported_layers(make_prompt_cache(lm))
        if unsupported:
            self.speculation_off = (f"its cache layers ({', '.join(unsupported)}) cannot be rolled "
                                    "back past rejected drafts")
            log.warning("model %r: speculative decoding is off because %s; every request is "
                        "served by the batched fallback", self.model.id, self.speculation_off)
        else:
            try:
                self.drafter.load(lm)
            except ValueError as exc:  # a draft that does not fit this target
                raise ModelError(f"model {self.model.id!r}: {exc}") from None
        return lm, tokenizer

    def shutdown(self) -> None:
        with self._start_lock:
            primary, self.primary = self.primary, None
            fallback, self.fallback = self.fallback, None
            with _ENGINES_LOCK:
                if _ENGINES.get(self.model.id) is self:
                    del _ENGINES[self.model.id]
            if primary is not None:
                self._thread.run(primary.shutdown)
                self._thread.detach(primary)
            if fallback is not None:
                fallback.shutdown()

    def _require_started(self) -> BatchedEngine:
        fallback = self.fallback
        if fallback is None:
            raise RuntimeError(f"engine for model {self.model.id!r} is not started; call start() first")
        return fallback

    # -- what the pipeline and the memory guard ask -------------------------------------

    def limits(self) -> EngineLimits:
        return self._require_started().limits()

    def memory_hints(self) -> MemoryHints:
        # Both paths prefill with the same step and evaluate only the cache; the
        # fallback's decode batch is padded. What speculation adds on top comes through
        # the plugin's estimate_peak wrapper (extra_bytes).
        return self._require_started().memory_hints()

    def extra_bytes(self, query: PeakQuery) -> int:
        """What speculation adds to the target's estimate for ``query`` (see
        :func:`~.memory.speculative_extra_bytes`); ``query.cached_tokens`` counts as
        tokens to allocate, since a reused prefix is copied on this engine."""
        if self.speculation_off is not None:
            return 0
        return speculative_extra_bytes(
            query.model_config, self.drafter.footprint(), self.drafter.block_size,
            total_tokens=query.new_tokens + query.cached_tokens, chunk_size=query.chunk_size)

    def cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        # Which path serves a request is settled at submit, after the guard: a prefix
        # the fallback could reuse is copied on the primary path, so none is counted.
        return 0

    def reclaimable_bytes(self) -> int:
        fallback = self.fallback
        return fallback.reclaimable_bytes() if fallback is not None else 0

    def reclaim(self, nbytes: int) -> int:
        fallback = self.fallback
        return fallback.reclaim(nbytes) if fallback is not None else 0

    # -- tokenization ----------------------------------------------------------------

    def chat_template(self) -> str | None:
        return self._require_started().chat_template()

    def special_tokens(self) -> frozenset[str]:
        return self._require_started().special_tokens()

    def detokenizer(self) -> Any:
        return self._require_started().detokenizer()

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        return self._require_started().tokenize_chat(messages, **template_kwargs)

    def tokenize(self, text: str) -> list[int]:
        return self._require_started().tokenize(text)

    def cache_points(self, messages: Sequence[Mapping[str, Any]], prompt_tokens: Sequence[int],
                     **template_kwargs: Any) -> tuple[int, ...]:
        # The batched fallback's prefix cache is the one that keeps state at them.
        return self._require_started().cache_points(messages, prompt_tokens, **template_kwargs)

    # -- requests --------------------------------------------------------------------

    def primary_refusal(self, request: GenerationRequest) -> str | None:
        """Why the primary path cannot serve ``request`` (``None``: it can)."""
        if self.speculation_off is not None:
            return self.speculation_off
        optional = request.sampling.optional_fields_set()
        if optional:
            return "it sets " + ", ".join(sorted(optional))
        window = self.drafter.context_window
        total = len(request.prompt_tokens) + int(request.sampling.max_tokens or 0)
        if window is not None and total > window:
            return f"its prompt and max_tokens ({total} tokens) pass the draft's window of {window}"
        return None

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request`` on the primary path if it is idle and can serve it, else on
        the batched fallback; raises ``ValueError`` naming what makes it unservable."""
        fallback = self._require_started()
        primary = self.primary
        if len(request.prompt_tokens) == 0:
            raise ValueError("prompt_tokens is empty; a request needs at least one prompt token")
        check_sampling(request.sampling)
        if primary is not None and self.primary_refusal(request) is None:
            outputs: queue.SimpleQueue = queue.SimpleQueue()
            if primary.try_claim(request, outputs):
                self._thread.wake()
                return SpeculativeRequestHandle(request.request_id, outputs, self.abort)
        self.fallback_requests += 1
        return fallback.submit(request)

    def abort(self, request_id: str) -> None:
        primary = self.primary
        if primary is not None and primary.abort(request_id):
            self._thread.wake()
            return
        fallback = self.fallback
        if fallback is not None:
            fallback.abort(request_id)

    def progress(self) -> list[RequestProgress]:
        fallback, primary = self.fallback, self.primary
        return ((primary.progress() if primary is not None else [])
                + (fallback.progress() if fallback is not None else []))

    def stats(self) -> dict[str, Any]:
        fallback, primary = self.fallback, self.primary
        if fallback is None or primary is None:
            return {"model": self.model.id, "started": False}
        batched = fallback.stats()
        counters = primary.counters
        return {
            **batched,
            "queue_depth": int(batched.get("queue_depth", 0)),
            "running": int(batched.get("running", 0)) + int(primary.busy),
            "speculative": {
                "drafter": self.drafter.name,
                "enabled": self.speculation_off is None,
                "running": int(primary.busy),
                "requests": counters.requests,
                "fallback_requests": self.fallback_requests,
                "drafted_tokens": counters.drafted,
                "accepted_tokens": counters.accepted,
                "acceptance_rate": round(counters.acceptance_rate, 4),
                "cycles": counters.cycles,
            },
        }


__all__ = ["DFlashEngine", "DFlashSettings", "engine_for_model"]
