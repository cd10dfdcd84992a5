"""The prefill estimate is the same whether or not a model's family takes omlx-core's CPU
routes (:mod:`omlx_core.models.attention`, :mod:`omlx_core.models.mlp_route`), and it
covers the peak measured either way.

A route is a module global of the model's mlx-lm family, installed when a model of that
family is loaded through omlx-core: an estimate that asked whether it was installed
would change with what else the process had loaded (an embedding program, a test, a
second engine), so preflight could refuse here what it admits there."""

from __future__ import annotations

import json
import sys

import pytest

from omlx_core.models.attention import route_takes
from omlx_core.models.loader import load_model
from omlx_core.plugins.estimator.prefill import estimate_for_config
from omlx_core.testing import cached_model
from omlx_core.testing.models import routed_modules

PROMPT_TOKENS, CHUNK = 2048, 512


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_estimate_is_the_same_with_the_routes_or_without(family, monkeypatch):
    from mlx_lm.models import activations, base

    from benchmarks.estimator import measure_prefill_peak, random_prompt

    path = cached_model(family)
    config = json.loads((path / "config.json").read_text())
    model, _ = load_model(path)
    attention = routed_modules(model, "scaled_dot_product_attention", "_omlx_cpu_attention")
    swiglu = routed_modules(model, "swiglu", "_omlx_cpu_swiglu")
    assert attention and swiglu, "the routes are installed at load"
    # The later chunks are calls the attention route takes (it would hold no mask there).
    heads = config["num_attention_heads"]
    assert route_takes(1, heads, CHUNK, PROMPT_TOKENS - CHUNK)
    prompt = random_prompt(PROMPT_TOKENS, config["vocab_size"])

    routed_estimate = estimate_for_config(config, PROMPT_TOKENS, 0, CHUNK).total
    routed_peak = measure_prefill_peak(model, prompt, CHUNK).peak_bytes
    for name in attention:
        monkeypatch.setattr(sys.modules[name], "scaled_dot_product_attention",
                            base.scaled_dot_product_attention)
    for name in swiglu:
        monkeypatch.setattr(sys.modules[name], "swiglu", activations.swiglu)
    assert not routed_modules(model, "scaled_dot_product_attention", "_omlx_cpu_attention")
    plain_estimate = estimate_for_config(config, PROMPT_TOKENS, 0, CHUNK).total
    plain_peak = measure_prefill_peak(model, prompt, CHUNK).peak_bytes

    assert routed_estimate == plain_estimate
    assert routed_peak <= routed_estimate and plain_peak <= plain_estimate, (
        routed_peak, plain_peak, routed_estimate)
