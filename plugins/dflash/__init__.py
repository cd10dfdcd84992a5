"""The built-in ``dflash`` engine: speculative decoding, memory-guarded on both paths.

Registered like any third-party plugin (entry point ``dflash`` in the ``omlx_core``
group). What it provides through the public hooks:

- ``register_engines``: ``"dflash"`` -> :class:`~.engine.DFlashEngine`: a lone request is
  decoded by draft-and-verify (:mod:`.speculative`), the rest by a batched engine over
  the same loaded weights;
- ``register_settings``: ``[plugin.dflash]``: the drafter (``ngram``, prompt lookup, the
  default: no weights; ``model``, a smaller mlx-lm model; ``dflash``, a DFlash
  block-diffusion draft, :mod:`.block_diffusion`), its ``draft_path``, the verify
  width ``block_size``;
- ``resolve_scheduler``: a dflash engine's :class:`~.memory.BothPaths`, which hands the
  limits and the forward gate to the primary path's guard and to the fallback's
  scheduler, so the enforcer reaches whichever path serves on every poll (seed 002);
- ``estimate_peak`` (a wrapper): adds what speculation allocates (draft weights not yet
  loaded, draft KV, the verify forward's width) to every estimate of a dflash model, so
  preflight, admission and the forward gate all count it.

Built with its :class:`~omlx_core.host.EngineHost` (its drafter from the model's own
``[models.<id>]`` choices over ``[plugin.dflash]``); both paths report finished requests
to the host's sink, and the fallback keeps the host's lower cache tiers.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

from omlx_core.hookspecs import hookimpl
from omlx_core.scheduling import MemoryReceiver
from omlx_core.plugins.dflash.engine import DRAFTERS, DFlashEngine, DFlashSettings, engine_for_model
from omlx_core.plugins.dflash.memory import with_speculation
from omlx_core.settings import Setting

ENGINE_NAME = "dflash"

SETTINGS = (
    Setting("drafter", "choice", "what drafts the tokens a verify forward checks: ngram (prompt "
            "lookup, no weights), model (a smaller mlx-lm model at draft_path), dflash (a DFlash "
            "block-diffusion draft at draft_path)", choices=DRAFTERS, default="ngram"),
    Setting("draft_path", "str", "the draft's weights for the model and dflash drafters: a local "
            "directory or a Hugging Face repo id already in the local cache (never downloaded)",
            default=""),
    Setting("block_size", "int", "tokens one verify forward checks (the anchor and up to "
            "block_size - 1 drafts); 0: the drafter's own (ngram 8, model 5, dflash: its config)",
            minimum=0, maximum=64, default=0),
    Setting("draft_token_cost", "float", "what one more drafted position in a verify forward "
            "costs, as a share of a one-token forward: the ngram drafter drafts only as many "
            "tokens as its acceptance so far pays for", minimum=0.0, maximum=10.0, default=0.1),
    Setting("ngram_min", "int", "shortest suffix the ngram drafter looks up", minimum=1,
            maximum=16, default=1),
    Setting("ngram_max", "int", "longest suffix the ngram drafter looks up (tried first)",
            minimum=1, maximum=16, default=4),
)


@hookimpl
def register_settings(register: Callable[[Setting], None]) -> None:
    for setting in SETTINGS:
        register(setting)


@hookimpl
def register_engines(register: Callable[..., None]) -> None:
    register(ENGINE_NAME, DFlashEngine)


@hookimpl
def resolve_scheduler(engine: Any) -> MemoryReceiver | None:
    return engine.receiver if isinstance(engine, DFlashEngine) else None


@hookimpl(wrapper=True)
def estimate_peak(query: Any) -> Generator[None, Any, Any]:
    result = yield
    engine = engine_for_model(query.model_id)
    if result is None or engine is None:
        return result
    footprint = engine.drafter.footprint() if engine.speculation_off is None else None
    return with_speculation(result, footprint, engine.extra_bytes(query))


__all__ = ["ENGINE_NAME", "DFlashEngine", "DFlashSettings"]
