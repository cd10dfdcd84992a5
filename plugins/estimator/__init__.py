"""The built-in ``estimator`` plugin: ``estimate_peak`` from a model's ``config.json``.

It answers with :func:`omlx_core.memory.estimate.estimate_prefill_peak` (for a vision
model's prompt with images, combined with
:func:`~omlx_core.memory.estimate.estimate_vision_peak`: the vision tower's activations
and the merged embeddings are part of the prefill peak). A config it
cannot read (a dim missing or not a positive integer, an architecture whose layers it
does not model) is logged as an error once per model and answered with ``None``, so the
guard reports that no estimator covers the model instead of trusting a guess.
"""

from __future__ import annotations

import logging

from omlx_core.hookspecs import hookimpl
from omlx_core.memory.estimate import (
    EstimatorDisabledError,
    ModelDims,
    VisionDims,
    estimate_prefill_peak,
    estimate_with_images,
)
from omlx_core.memory.types import PeakQuery

log = logging.getLogger(__name__)

# model id (or model_type when there is none) -> why its estimator is off
_disabled: dict[str, str] = {}
# models whose config left out dims that were filled from mlx-lm's defaults (logged once)
_defaulted_logged: set[str] = set()


@hookimpl
def estimate_peak(query: PeakQuery) -> int | None:
    key = query.model_id or str(query.model_config.get("model_type", ""))
    try:
        dims = ModelDims.from_config(query.model_config)
    except EstimatorDisabledError as exc:
        if _disabled.get(key) != str(exc):
            _disabled[key] = str(exc)
            log.error("prefill memory estimator disabled for model %r: %s; its requests are "
                      "not checked against memory", key, exc)
        return None
    _disabled.pop(key, None)
    if dims.defaulted and key not in _defaulted_logged:
        _defaulted_logged.add(key)
        log.warning("model %r config leaves out %s; the memory estimate uses the values "
                    "mlx-lm builds the model with", key, ", ".join(dims.defaulted))
    breakdown = estimate_prefill_peak(
        dims, query.new_tokens, query.cached_tokens, query.chunk_size,
        dtype_bytes=query.dtype_bytes, kv_bits=query.kv_bits, kv_group_size=query.kv_group_size,
        full_logits=query.full_logits, first_token=query.first_token,
        cached_kv_resident=query.cached_kv_resident, backend=query.backend)
    if query.images:
        try:
            vision_dims = VisionDims.from_config(query.model_config)
        except EstimatorDisabledError as exc:
            reason = f"the request has images but {exc}"
            if _disabled.get(key) != reason:
                _disabled[key] = reason
                log.error("prefill memory estimator cannot cost images for model %r: %s", key, exc)
            return None
        breakdown = estimate_with_images(
            dims, vision_dims, breakdown, images=query.images, new_tokens=query.new_tokens,
            dtype_bytes=query.dtype_bytes, kv_bits=query.kv_bits, kv_group_size=query.kv_group_size)
    log.debug("prefill estimate for model %r: %s", key, breakdown.describe())
    return breakdown.total


def disabled_models() -> dict[str, str]:
    """Models whose estimator is off, each with the reason (for status pages and tests)."""
    return dict(_disabled)
