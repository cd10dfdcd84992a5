"""The peak of an encode forward (embeddings, relevance scores): ``rows`` sequences padded
to one width, run once, caching nothing.

- **BERT-family encoders** (the ``encoder`` plugin's mlx.nn model): measured with
  ``mx.get_peak_memory()`` on the CPU backend over hidden widths 32-768, intermediate
  64-3072, 4-32 heads, 2-12 layers, 1-256 rows of 16-1,024 tokens
  (``tests/test_encoder_estimate.py``; ``python -m benchmarks.embeddings --peaks`` on the
  shipped model): mlx's eval runs ahead about a layer, so a forward holds per token a
  number of hidden-wide activations and about one intermediate-wide one at once, plus
  the attention scores (``heads x width x width`` a row) and part of a copy. On the
  CPU backend in float32 the GELU runs in place in NumPy and the softmax through the
  CPU attention route (the encoder's CPU routes), which leaves fewer hidden-wide arrays
  alive (:data:`HIDDEN_PER_TOKEN_ROUTED`, 10-46 % over the measured peaks) than mlx's
  own ops (:data:`HIDDEN_PER_TOKEN`, 5-20 % over them before those routes).
- **Decoders** (an mlx-lm model run for its hidden states): one layer's allocations for
  all the rows at once, as for a prefill chunk over no cache (its keys and values are
  transient: nothing keeps them), every layer run (the final states are evaluated),
  plus the embeddings and final states.

Nothing stays held after the forward but the pooled rows, which are counted in the
transient too.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from omlx_core.memory.types import PeakEstimate, PeakQuery
from omlx_core.plugins.estimator.dims import (
    LINEAR,
    EstimatorDisabledError,
    ModelDims,
    positive_int,
)
from omlx_core.plugins.estimator.prefill import (
    FIXED_OVERHEAD_BYTES,
    LAYER_MARGIN,
    attention_activation_bytes,
    attention_scores_bytes,
    latent_attention_bytes,
    linear_scan_bytes,
    mlp_bytes,
    moe_bytes,
)

#: model_types the encoder plugin's BERT-family model builds
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})
HIDDEN_PER_TOKEN = 20
HIDDEN_PER_TOKEN_ROUTED = 17
INTERMEDIATE_PER_TOKEN = 1.25
SCORE_COPIES = 1.25


def is_encoder_config(config: Mapping[str, Any]) -> bool:
    return str(config.get("model_type", "")) in ENCODER_MODEL_TYPES


def encoder_forward_bytes(config: Mapping[str, Any], rows: int, width: int,
                          dtype_bytes: int, backend: str = "cpu") -> int:
    """The peak a BERT-family encoder's forward of ``rows`` x ``width`` tokens adds."""
    hidden = positive_int(config.get("hidden_size"), "hidden_size")
    intermediate = positive_int(config.get("intermediate_size"), "intermediate_size")
    heads = positive_int(config.get("num_attention_heads"), "num_attention_heads")
    tokens = rows * width
    routed = backend == "cpu" and dtype_bytes == 4
    per_hidden = HIDDEN_PER_TOKEN_ROUTED if routed else HIDDEN_PER_TOKEN
    activations = tokens * (per_hidden * hidden + INTERMEDIATE_PER_TOKEN * intermediate)
    scores = SCORE_COPIES * heads * rows * width * width
    return int((activations + scores) * dtype_bytes) + FIXED_OVERHEAD_BYTES


def decoder_forward_bytes(dims: ModelDims, rows: int, width: int, dtype_bytes: int,
                          backend: str) -> int:
    """The peak a decoder's cache-less forward of ``rows`` x ``width`` tokens adds: one
    layer's allocations alive at once (:data:`~.prefill.LAYER_MARGIN`), as for a prefill
    chunk over no cache, its keys and values among them (nothing keeps them), plus the
    embeddings and the final states every layer ends in."""
    tokens = rows * width
    wide = max(dtype_bytes, 4)
    if dims.latent is not None:
        scores = rows * latent_attention_bytes(dims, width, width, dtype_bytes)
    elif backend == "metal" and dims.head_dim in (64, 80, 128):
        scores = 0
    else:
        scores = rows * attention_scores_bytes(dims.num_heads, width, width, dtype_bytes)
    dense = mlp_bytes(dims, tokens, wide) if dims.intermediate_size else 0
    layer = scores + attention_activation_bytes(dims, tokens, wide) + max(
        dense, moe_bytes(dims, tokens, wide))
    if LINEAR in dims.layer_kinds:
        layer = max(layer, linear_scan_bytes(dims, tokens, dtype_bytes, backend))
    states = 2 * tokens * dims.hidden_size * wide
    return math.ceil(LAYER_MARGIN * layer) + states + FIXED_OVERHEAD_BYTES


def estimate_encode(query: PeakQuery) -> PeakEstimate:
    """The :class:`PeakEstimate` of an encode forward: all transient.

    :raises EstimatorDisabledError: the config lacks a dim the estimate needs.
    """
    rows, width = max(1, query.rows), max(1, query.new_tokens)
    if is_encoder_config(query.model_config):
        peak = encoder_forward_bytes(query.model_config, rows, width, query.dtype_bytes,
                                     query.backend)
    else:
        peak = decoder_forward_bytes(ModelDims.from_config(query.model_config), rows, width,
                                     query.dtype_bytes, query.backend)
    return PeakEstimate(transient_bytes=int(peak), kv_bytes_per_token=0)


__all__ = ["ENCODER_MODEL_TYPES", "EstimatorDisabledError", "decoder_forward_bytes",
           "encoder_forward_bytes", "estimate_encode", "is_encoder_config"]
