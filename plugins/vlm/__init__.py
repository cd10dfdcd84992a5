"""The built-in ``vlm`` engine: image + text chat on mlx-vlm models, continuously batched.

Registered like any third-party plugin (entry point ``vlm`` in the ``omlx_core``
group); install its dependencies with the ``vlm`` extra. Through the public hooks:

- ``register_settings``: ``[plugin.vlm]`` image limits (``max_images``,
  ``max_image_pixels``, ``max_image_bytes``) and ``allowed_image_dirs``, the local
  directories a client may name image files in (none by default);
- ``register_engines``: ``"vlm"`` -> :class:`~.engine.VLMEngine`, a batched engine
  (its batch, prefill and prefix cache keys are ``[plugin.batched]``'s) whose language
  model is the mlx-lm model of the VLM's text side (:mod:`.model`) and whose requests
  carry images (:mod:`.images`, :mod:`.scheduler`);
- ``resolve_scheduler``: a vlm engine's scheduler, its memory receiver.

Serve a model with it in the registry: ``[models.<id>] engine = "vlm"``. Preflight
counts each image at :mod:`.bound`'s upper bound before any image is decoded.
"""

from __future__ import annotations

from typing import Any, Callable

from omlx_core.hookspecs import hookimpl
from omlx_core.settings import Setting

ENGINE_NAME = "vlm"

SETTINGS = (
    Setting("max_images", "int", "most images one request may carry", minimum=0, maximum=256,
            default=8),
    Setting("max_image_pixels", "int", "most pixels (width x height) an image may declare; "
            "larger ones are refused before decoding", minimum=1, maximum=1 << 31,
            default=33_554_432),
    Setting("max_image_bytes", "size", "largest encoded image accepted", default=20 << 20),
    Setting("allowed_image_dirs", "list", "local directories a client may name image files "
            "in (file:// URLs or paths); empty: local files are refused", default=[]),
)


@hookimpl
def register_settings(register: Callable[[Setting], None]) -> None:
    for setting in SETTINGS:
        register(setting)


@hookimpl
def register_engines(register: Callable[..., None]) -> None:
    from omlx_core.plugins.vlm.engine import VLMEngine

    register(ENGINE_NAME, VLMEngine)


@hookimpl
def resolve_scheduler(engine: Any) -> Any:
    from omlx_core.plugins.vlm.engine import VLMEngine

    return engine.scheduler if isinstance(engine, VLMEngine) else None
