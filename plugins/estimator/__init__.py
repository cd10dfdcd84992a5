"""The built-in ``estimator`` plugin: ``estimate_peak`` from a model's ``config.json``.

It reads the language model's dims (:mod:`.dims`), simulates the prefill chunk by chunk
as mlx-lm allocates it (:mod:`.prefill`), costs an encode forward (embeddings, scores:
:mod:`.encoder`) and, for a vision model's prompt with images,
adds the vision tower's activations and the image features (:mod:`.vision`). It
answers with a :class:`~omlx_core.memory.types.PeakEstimate`: the worst step's
transient, the KV per token and the cache the prefill leaves held, and the image
features as extra bytes. A config it cannot read (a dim missing or not a positive
integer, an architecture whose layers it does not model) is logged as an error once per
model and answered with ``None``, so the guard reports that no estimator covers the
model instead of trusting a guess.
"""

from __future__ import annotations

import logging

from omlx_core.hookspecs import hookimpl
from omlx_core.memory.types import PeakEstimate, PeakQuery
from omlx_core.plugins.estimator.dims import EstimatorDisabledError, ModelDims
from omlx_core.plugins.estimator.encoder import estimate_encode, is_encoder_config
from omlx_core.plugins.estimator.prefill import PeakBreakdown, estimate_prefill_peak
from omlx_core.plugins.estimator.vision import VisionDims, estimate_with_images

log = logging.getLogger(__name__)

# model id (or model_type when there is none) -> why its estimator is off
_disabled: dict[str, str] = {}
# models whose config left out dims that were filled from mlx-lm's defaults (logged once)
_defaulted_logged: set[str] = set()


@hookimpl
def estimate_peak(query: PeakQuery) -> PeakEstimate | None:
    if query.encode or is_encoder_config(query.model_config):
        return _encode_estimate(query)
    breakdown = estimate_breakdown(query)
    return None if breakdown is None else breakdown.as_estimate()


def _encode_estimate(query: PeakQuery) -> PeakEstimate | None:
    """An encode forward's estimate (:mod:`.encoder`); ``None``, logged once, when the
    model's config cannot give one."""
    key = query.model_id or str(query.model_config.get("model_type", ""))
    try:
        estimate = estimate_encode(query)
    except EstimatorDisabledError as exc:
        if _disabled.get(key) != str(exc):
            _disabled[key] = str(exc)
            log.error("encode memory estimator disabled for model %r: %s; its requests are "
                      "not checked against memory", key, exc)
        return None
    _disabled.pop(key, None)
    return estimate


def estimate_breakdown(query: PeakQuery) -> PeakBreakdown | None:
    """The named parts of the estimate for ``query`` (``None``: the model's config cannot
    be estimated; the reason is logged once and listed by :func:`disabled_models`)."""
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
    return breakdown


def disabled_models() -> dict[str, str]:
    """Models whose estimator is off, each with the reason (for status pages and tests)."""
    return dict(_disabled)
