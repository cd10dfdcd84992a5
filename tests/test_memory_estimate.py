"""The prefill peak estimate: config extraction, each component's formula, and real
prefills on every tiny family measured with ``mx.get_peak_memory()``."""

from __future__ import annotations

import math
from unittest import mock

import pytest

from omlx_core.memory.types import KV_STEP, PeakEstimate, PeakQuery
from omlx_core.plugins.estimator.dims import (
    FULL,
    LINEAR,
    SLIDING,
    EstimatorDisabledError,
    ModelDims,
    quantized_row_bytes,
)
from omlx_core.plugins.estimator.prefill import (
    attention_scores_bytes,
    estimate_for_config,
    estimate_prefill_peak,
    grown_capacity,
    latent_attention_bytes,
    linear_scan_bytes,
    logits_bytes,
    rotating_length,
)
from omlx_core.testing import FAMILIES, family_config

MIB = 2**20

LLAMA_TEXT = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
}
VISION = {"model_type": "siglip_vision_model", "num_hidden_layers": 27, "hidden_size": 1152,
          "num_attention_heads": 16, "intermediate_size": 4304}

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256,
    moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
    n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.0, kv_lora_rank=64,
    q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
    num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
    attention_bias=False)


# -- config extraction --------------------------------------------------------------------


def test_plain_config_dims():
    dims = ModelDims.from_config(family_config("llama"))
    assert (dims.num_layers, dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim,
            dims.intermediate_size, dims.vocab_size) == (2, 64, 4, 2, 16, 128, 512)
    assert dims.layer_kinds == (FULL, FULL)
    assert dims.source == "top level"


@pytest.mark.parametrize("nest_key", ["text_config", "language_config", "llm_config"])
def test_vlm_nested_language_config_wins(nest_key):
    config = {"model_type": "llava", nest_key: LLAMA_TEXT, "vision_config": VISION}
    dims = ModelDims.from_config(config)
    assert dims.source == nest_key
    assert (dims.num_layers, dims.hidden_size, dims.num_heads) == (2, 64, 4)


def test_vlm_nested_wins_even_when_top_level_has_a_layer_count():
    # The top level describes the vision tower: 27 layers, 1152 wide.
    config = {**VISION, "model_type": "gemma3", "text_config": {**LLAMA_TEXT, "model_type": "llama"}}
    dims = ModelDims.from_config(config)
    assert dims.source == "text_config"
    assert (dims.num_layers, dims.hidden_size, dims.intermediate_size) == (2, 64, 128)


def test_vlm_nested_with_legacy_layer_count():
    config = {**VISION, "llm_config": {"n_layer": 3, "n_head": 4, "n_embd": 64, "vocab_size": 512}}
    dims = ModelDims.from_config(config)
    assert dims.source == "llm_config" and dims.num_layers == 3


def test_vlm_text_config_leaving_out_dims_uses_what_mlx_lm_builds():
    # gemma-3-4b-it's config: the text block relies on defaults, the vocab is top level.
    config = {"model_type": "gemma3", "vocab_size": 262208,
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                              "intermediate_size": 10240, "num_hidden_layers": 34,
                              "sliding_window": 1024},
              "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}
    dims = ModelDims.from_config(config)
    assert (dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.vocab_size) == (8, 4, 256, 262208)
    assert dims.layer_kinds.count(FULL) == 34 // 6 and dims.sliding_window == 1024
    assert "text_config.num_attention_heads" in dims.defaulted


def test_nested_block_without_layer_count_is_not_the_language_model():
    config = {**LLAMA_TEXT, "text_config": {"vocab_size": 99}}
    assert ModelDims.from_config(config).source == "top level"


def test_legacy_gpt2_keys():
    dims = ModelDims.from_config({"model_type": "gpt2", "n_layer": 12, "n_head": 12,
                                  "n_embd": 768, "vocab_size": 50257, "n_inner": None})
    assert (dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (12, 12, 12, 64)
    assert dims.intermediate_size == 4 * 768


@pytest.mark.parametrize("value", [0, -4, None, "32", 12.5, True, [2], mock.MagicMock()])
def test_bad_dim_raises_naming_key_and_value(value):
    config = {**LLAMA_TEXT, "num_attention_heads": value}
    with pytest.raises(EstimatorDisabledError) as info:
        ModelDims.from_config(config)
    message = str(info.value)
    assert "num_attention_heads" in message
    if value is not None:
        assert repr(value) in message


def test_bad_nested_dim_names_the_nested_key():
    config = {"model_type": "llava", "text_config": {**LLAMA_TEXT, "hidden_size": 0}}
    with pytest.raises(EstimatorDisabledError, match=r"text_config\.hidden_size=0"):
        ModelDims.from_config(config)


def test_missing_dim_raises():
    config = dict(LLAMA_TEXT)
    del config["vocab_size"]
    with pytest.raises(EstimatorDisabledError, match="vocab_size"):
        ModelDims.from_config(config)


def test_integral_float_dims_are_accepted():
    dims = ModelDims.from_config({**LLAMA_TEXT, "hidden_size": 64.0})
    assert dims.hidden_size == 64 and isinstance(dims.hidden_size, int)


def test_non_mapping_config_raises():
    with pytest.raises(EstimatorDisabledError):
        ModelDims.from_config(["not", "a", "config"])  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [
    {**LLAMA_TEXT, "model_type": "mamba2"},
    {**LLAMA_TEXT, "model_type": "some_hybrid", "ssm_state_size": 128},
    {**LLAMA_TEXT, "model_type": "some_hybrid", "layer_types": ["linear_attention", "full_attention"]},
])
def test_unmodeled_recurrent_architectures_are_refused(config):
    with pytest.raises(EstimatorDisabledError, match="recurrent"):
        ModelDims.from_config(config)


def test_layer_kinds_per_family():
    gemma = ModelDims.from_config(family_config("gemma3"))
    assert gemma.layer_kinds == (SLIDING, FULL, SLIDING, FULL) and gemma.sliding_window == 16
    qwen3_next = ModelDims.from_config(family_config("qwen3_next"))
    assert qwen3_next.layer_kinds == (LINEAR, LINEAR, LINEAR, FULL)
    assert qwen3_next.linear is not None and qwen3_next.linear.conv_dim == 2 * 2 * 32 + 4 * 16
    moe = ModelDims.from_config(family_config("qwen3_moe")).moe
    assert moe is not None and (moe.num_experts, moe.experts_per_token, moe.intermediate_size) == (8, 2, 32)
    llama_sliding = ModelDims.from_config({**LLAMA_TEXT, "sliding_window": 32,
                                           "layer_types": ["sliding_attention", "full_attention"]})
    assert llama_sliding.layer_kinds == (SLIDING, FULL)
    # A window mlx-lm does not apply (no layer_types) is costed as full attention.
    assert ModelDims.from_config({**LLAMA_TEXT, "sliding_window": 32}).layer_kinds == (FULL, FULL)


def test_latent_cache_only_where_mlx_lm_caches_the_latent():
    v3 = ModelDims.from_config(DEEPSEEK_V3)
    assert v3.latent is not None
    assert v3.kv_bytes_per_token(2) == (64 + 16) * 2
    # deepseek_v2 in mlx-lm caches per-head keys (nope + rope) and values.
    v2 = ModelDims.from_config({**DEEPSEEK_V3, "model_type": "deepseek_v2"})
    assert v2.latent is None
    assert v2.kv_bytes_per_token(2) == 8 * ((32 + 16) + 32) * 2


# -- component formulas -------------------------------------------------------------------


@pytest.mark.parametrize("offset,capacity,appended,expected", [
    (0, 0, 1, 256), (0, 0, 256, 256), (0, 0, 257, 512), (100, 256, 50, 256),
    (256, 256, 10, 512), (250, 256, 10, 506), (300, 512, 300, 812), (511, 512, 1, 512),
])
def test_grown_capacity(offset, capacity, appended, expected):
    assert grown_capacity(offset, capacity, appended) == expected


def test_capacity_follows_the_chunk_sequence_not_just_the_token_count():
    capacity = offset = 0
    for chunk in (300, 300):
        capacity = grown_capacity(offset, capacity, chunk)
        offset += chunk
    # Two unaligned chunks: 512, then 300 kept + 512 = 812 > ceil(600 / 256) * 256 = 768.
    assert capacity == 812 > math.ceil(600 / KV_STEP) * KV_STEP


def test_rotating_length_keeps_window_minus_one_plus_chunk():
    assert rotating_length(0, 16, 256) == 256
    assert rotating_length(256, 16, 256) == 15 + 256
    assert rotating_length(10, 16, 4) == 14


def test_attention_scores_formula():
    assert attention_scores_bytes(9, 512, 1024, 4) == 9 * 512 * 1024 * 4 + 512 * 1024
    assert attention_scores_bytes(9, 1, 1024, 2) == 9 * 1024 * 2  # no mask for one token


def test_latent_attention_formula():
    dims = ModelDims.from_config(DEEPSEEK_V3)
    expected = 2 * 8 * 64 * 256 * 4 + 64 * 256 + 8 * 256 * (32 + 32) * 4
    assert latent_attention_bytes(dims, 64, 256, 4) == expected


def test_quantized_row_bytes():
    assert quantized_row_bytes(64, 2, None, 64) == 128
    assert quantized_row_bytes(64, 2, 8, 64) == 64 + 2 * 2  # packed bytes + scale and bias
    assert quantized_row_bytes(128, 2, 4, 64) == 64 + 2 * 2 * 2


def test_linear_state_and_scan():
    dims = ModelDims.from_config(family_config("qwen3_next"))
    lin = dims.linear
    assert lin.state_bytes(4) == 3 * lin.conv_dim * 4 + 4 * 16 * 32 * 4
    cpu = linear_scan_bytes(dims, 256, 4)
    assert cpu > 256 * 4 * 16 * 32 * 4  # every step's recurrent state
    assert linear_scan_bytes(dims, 256, 4, backend="metal") < cpu / 4


def test_logits_formula():
    dims = ModelDims.from_config(family_config("llama"))
    assert logits_bytes(dims, 3, 2) == 3 * 512 * (2 + 4)


def test_breakdown_adds_up_and_names_what_dominates():
    dims = ModelDims.from_config(family_config("llama"))
    breakdown = estimate_prefill_peak(dims, 2048, 0, 2048)
    assert breakdown.total == sum(breakdown.components.values())
    assert breakdown.dominant == "attention_scores"
    assert breakdown.describe().startswith(f"{breakdown.total / MIB:.1f} MiB")
    assert "attention_scores" in breakdown.describe()


def test_logits_only_when_the_engine_evaluates_them():
    dims = ModelDims.from_config(family_config("llama", {"vocab_size": 50000}))
    lean = estimate_prefill_peak(dims, 1024, 0, 1024, first_token=False)
    full = estimate_prefill_peak(dims, 1024, 0, 1024, first_token=False, full_logits=True)
    assert "logits" not in lean.components
    assert full.components["logits"] == logits_bytes(dims, 1024, 4)


def test_last_layer_attention_never_runs():
    # qwen3_next's only full-attention layer is its last: no scores are ever computed.
    dims = ModelDims.from_config(family_config("qwen3_next"))
    breakdown = estimate_prefill_peak(dims, 4096, 0, 2048)
    assert "attention_scores" not in breakdown.components
    assert breakdown.dominant == "linear_attention_scan"


def test_estimate_grows_with_tokens_and_chunk():
    dims = ModelDims.from_config(family_config("qwen3"))
    by_tokens = [estimate_prefill_peak(dims, n, 0, 512).total for n in (64, 512, 2048, 8192)]
    assert by_tokens == sorted(by_tokens) and len(set(by_tokens)) == 4
    by_chunk = [estimate_prefill_peak(dims, 8192, 0, c).total for c in (256, 512, 2048)]
    assert by_chunk == sorted(by_chunk) and len(set(by_chunk)) == 3


def test_resident_cached_tokens_are_not_counted_again():
    dims = ModelDims.from_config(family_config("llama"))
    resident = estimate_prefill_peak(dims, 512, 4096, 512)
    copied = estimate_prefill_peak(dims, 512, 4096, 512, cached_kv_resident=False)
    assert copied.total - resident.total >= 4096 * dims.kv_bytes_per_token(4) * dims.num_layers


def test_invalid_arguments():
    dims = ModelDims.from_config(family_config("llama"))
    with pytest.raises(ValueError):
        estimate_prefill_peak(dims, -1)
    with pytest.raises(ValueError):
        estimate_prefill_peak(dims, 10, chunk_size=0)
    with pytest.raises(ValueError):
        estimate_prefill_peak(dims, 10, backend="tpu")
    assert estimate_prefill_peak(dims, 0).total == 0


def test_estimator_plugin_answers_the_hook_and_refuses_bad_configs(caplog):
    from omlx_core.pluginmanager import PluginManager
    from omlx_core.plugins import estimator

    manager = PluginManager(enabled=())
    manager.register(estimator, "estimator")
    query = PeakQuery(model_config=family_config("llama"), new_tokens=1000, chunk_size=300,
                      model_id="tiny")
    expected = estimate_for_config(family_config("llama"), 1000, 0, 300)
    answer = manager.hook.estimate_peak(query=query)
    assert isinstance(answer, PeakEstimate) and answer.total == expected.total

    bad = PeakQuery(model_config={**LLAMA_TEXT, "num_attention_heads": None}, new_tokens=10,
                    model_id="broken")
    with caplog.at_level("ERROR"):
        assert manager.hook.estimate_peak(query=bad) is None
    assert "estimator disabled for model 'broken'" in caplog.text
    assert "num_attention_heads" in estimator.disabled_models()["broken"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("new_tokens,cached,chunk", [(1, 0, 1), (700, 0, 256), (300, 900, 512),
                                                     (4096, 0, 2048)])
def test_the_structured_estimate_is_the_breakdown_split_in_parts(family, new_tokens, cached, chunk):
    from omlx_core.plugins.estimator import estimate_peak

    config = family_config(family)
    dims = ModelDims.from_config(config)
    breakdown = estimate_for_config(config, new_tokens, cached, chunk)
    estimate = estimate_peak(PeakQuery(config, new_tokens, cached, chunk_size=chunk))
    # The same bytes as the one number the hook answered before it was structured.
    assert estimate.total == breakdown.total
    assert min(estimate.transient_bytes, estimate.kv_bytes) >= 0 and estimate.extra_bytes == 0
    growing = dims.count(FULL) + dims.count(SLIDING)
    assert estimate.kv_bytes_per_token == growing * dims.kv_bytes_per_token(4) > 0
    # The KV a prefill leaves holds every new token, in cache steps: at most the steps
    # the decode join adds (the batch cache: the whole context and one more step).
    full_kv = dims.count(FULL) * dims.kv_bytes_per_token(4)
    assert full_kv * new_tokens <= estimate.kv_bytes
    if dims.count(FULL) == len(dims.layer_kinds):
        assert estimate.kv_bytes <= full_kv * (new_tokens + 2 * KV_STEP)
    assert estimate.held_bytes == estimate.kv_bytes <= estimate.total


def test_a_structured_estimate_refuses_negative_parts_and_adds_extra_bytes():
    estimate = PeakEstimate(transient_bytes=100, kv_bytes_per_token=8, kv_bytes=800)
    assert estimate.total == 900 and estimate.held_bytes == 800
    wider = estimate.plus_extra(50, kv_bytes_per_token=2)
    assert (wider.total, wider.kv_bytes_per_token, wider.held_bytes) == (950, 10, 850)
    with pytest.raises(ValueError, match="transient_bytes"):
        PeakEstimate(transient_bytes=-1, kv_bytes_per_token=0)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        PeakEstimate(transient_bytes=0, kv_bytes_per_token=1.5)


# -- real prefills ------------------------------------------------------------------------

# Tiny models carry a fixed per-forward overhead (token ids, RoPE tables, mask index
# vectors: ~0.1 MiB) and a layer-allocation allowance that is large next to their
# sub-MiB KV, so below 2k tokens the overcount bound is looser. The models are measured
# as the server runs them, with the CPU routes installed at load: the attention route
# masks the scores in place and holds no mask, which the estimate counts anyway (so it
# is the same whatever this process loaded, tests/test_memory_estimate_routes.py). For
# a tiny model's 4 heads that mask is 1/17 of the score matrix that dominates a 2k
# prompt's peak (for the default model's 9 bfloat16 heads, 1/19): measured 1.185 for
# the tiny llama's 2k prompt in 512-token chunks, 1.192 over 1,536 cached tokens, 1.202
# for qwen3's full logits (1.222 on a CI machine; and 1.200 there for the tiny MoE, whose
# 32-wide experts the MoE allowance sized for real expert widths overcounts). The 2k+
# bound carries that plus the few hundred KiB the measured peaks differ by between
# machines.
TINY_MAX_RATIO_SHORT = 1.35
TINY_MAX_RATIO_LONG = 1.24
REAL_RUNS = [(512, 256), (1000, 300), (2048, 512), (2048, 2048)]
#: measurements of one prefill at most, while its estimate reads over the bound
PEAK_RUNS = 3


def largest_peak(measure, estimate_bytes: int, bound: float) -> int:  # type: ignore[no-untyped-def]
    """The largest of the peaks ``measure()`` reads, measuring again (up to
    :data:`PEAK_RUNS` in all) while ``estimate_bytes`` is over ``bound`` times it. On mlx's
    CPU stream a buffer lives from its operation's dispatch until the worker has run what
    reads it, so a run whose worker kept up with dispatch reads low (a tiny model's 2-3 MiB
    prefill read 15-20 % low beside a busy thread in the same process): the estimate
    bounds the largest run. Measuring again only raises the peak, so it never hides an
    undercount."""
    peak = measure()
    for _ in range(PEAK_RUNS - 1):
        if estimate_bytes <= bound * peak:
            break
        peak = max(peak, measure())
    return peak


def process_state() -> str:
    """What else in this process could have used mlx beside a measurement, for an
    undercount's message: threads alive and the MLX thread's workers."""
    import threading

    import mlx.core as mx

    from omlx_core.mlx_thread import mlx_thread

    workers = [f"{type(w).__name__} (work: {w.has_work()})" for w in mlx_thread().workers()]
    return (f"{threading.active_count()} threads; MLX thread workers: {workers or 'none'}; "
            f"mlx memory limit {mx.get_memory_limit() / MIB:.0f} MiB, cache "
            f"{mx.get_cache_memory() / MIB:.1f} MiB")


@pytest.fixture(scope="module")
def loaded_models(tmp_path_factory):
    from omlx_core.models.loader import load_model
    from omlx_core.testing import cached_model

    root = tmp_path_factory.mktemp("estimate-models")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = load_model(cached_model(family, cache_dir=root))[0]
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("prompt_tokens,chunk", REAL_RUNS)
def test_real_prefill_never_undercounts(loaded_models, family, prompt_tokens, chunk):
    from benchmarks.estimator import measure_prefill_peak, random_prompt

    estimate = estimate_for_config(family_config(family), prompt_tokens, 0, chunk)
    bound = TINY_MAX_RATIO_LONG if prompt_tokens >= 2048 else TINY_MAX_RATIO_SHORT
    peak = largest_peak(lambda: measure_prefill_peak(
        loaded_models(family), random_prompt(prompt_tokens, 512), chunk).peak_bytes,
        estimate.total, bound)
    ratio = estimate.total / peak
    detail = (f"{family} {prompt_tokens} tokens / chunk {chunk}: measured "
              f"{peak / MIB:.2f} MiB, {estimate.describe()} (ratio {ratio:.3f})")
    if ratio < 1.0:
        # Seen once in a CI run (qwen3_next, 2048/2048: 5.5 MiB over the usual peak) and
        # never when repeated: say whether the same prefill measures the same again.
        again = measure_prefill_peak(loaded_models(family), random_prompt(prompt_tokens, 512), chunk)
        detail += (f"; measured again at once: {again.peak_bytes / MIB:.2f} MiB; "
                   f"{process_state()}")
    assert ratio >= 1.0, "undercount: " + detail
    assert ratio <= bound, "overcount: " + detail


def test_real_prefill_over_resident_cached_tokens(loaded_models):
    from benchmarks.estimator import measure_prefill_peak, random_prompt

    estimate = estimate_for_config(family_config("llama"), 512, 1536, 512)
    peak = largest_peak(lambda: measure_prefill_peak(
        loaded_models("llama"), random_prompt(2048, 512), 512, cached_tokens=1536).peak_bytes,
        estimate.total, TINY_MAX_RATIO_LONG)
    assert 1.0 <= estimate.total / peak <= TINY_MAX_RATIO_LONG, estimate.describe()


def test_real_prefill_with_full_logits(loaded_models):
    from benchmarks.estimator import measure_prefill_peak, random_prompt

    estimate = estimate_for_config(family_config("qwen3"), 2048, 0, 1024, full_logits=True)
    peak = largest_peak(lambda: measure_prefill_peak(
        loaded_models("qwen3"), random_prompt(2048, 512), 1024, evaluate_logits=True).peak_bytes,
        estimate.total, TINY_MAX_RATIO_LONG)
    assert 1.0 <= estimate.total / peak <= TINY_MAX_RATIO_LONG, estimate.describe()


# A quantized cache on the CPU backend: the route expands a layer's KV and attends it
# like an unquantized one (no mask held; measured 1.23-1.24 on the tiny 3-layer llama),
# while the estimate also covers mlx's own quantized attention, which holds more.
TINY_MAX_RATIO_QUANTIZED = 1.26


@pytest.mark.parametrize("bits", [8, 4])
def test_real_prefill_with_quantized_kv(bits):
    import mlx.core as mx

    from benchmarks.estimator import measure_prefill_peak, random_prompt
    from omlx_core.models.loader import install_cpu_routes, model_classes
    from omlx_core.scheduling.kv_cache import RotatedQuantizedKVCache
    from omlx_core.scheduling.kv_tiles import TiledKVCache

    config = family_config("llama", {"head_dim": 64, "num_hidden_layers": 3})
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    install_cpu_routes(model)  # the served path: the layer's KV dequantized, then attended
    estimate = estimate_for_config(config, 2048, 0, 512, kv_bits=bits, first_token=False)

    def measure() -> int:
        # The served format: 4-bit keys per channel in tiles, 8-bit rows.
        cache = [TiledKVCache(64, bits) if bits == 4 else RotatedQuantizedKVCache(group_size=64, bits=bits)
                 for _ in range(3)]
        return measure_prefill_peak(model, random_prompt(2048, 512), 512, first_token=False,
                                    cache=cache).peak_bytes

    peak = largest_peak(measure, estimate.total, TINY_MAX_RATIO_QUANTIZED)
    assert 1.0 <= estimate.total / peak <= TINY_MAX_RATIO_QUANTIZED, estimate.describe()




@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_next"])
def test_rotated_quantized_kv_is_covered_on_every_family(family):
    """A quantized cache is stored rotated, so a layer briefly holds rotated copies of a
    chunk's queries, keys, values and output besides what it held before. The estimate
    lists no component for them: they fit in what it counts for mlx's own quantized
    attention (which holds more than the CPU route does). This holds on the families
    with other layers beside plain attention (sliding windows, recurrent layers), for a
    512-token prompt in one chunk and 2,048 tokens in 512-token chunks (measured
    1.07-1.20)."""
    import mlx.core as mx

    from benchmarks.estimator import measure_prefill_peak, random_prompt
    from omlx_core.models.loader import install_cpu_routes, model_classes
    from omlx_core.scheduling.kv_cache import KVFormat, make_request_cache

    config = family_config(family, {"head_dim": 64})
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    install_cpu_routes(model)
    for prompt_tokens, chunk in ((512, 512), (2048, 512)):
        estimate = estimate_for_config(config, prompt_tokens, 0, chunk, kv_bits=4, first_token=False)

        def measure() -> int:
            cache = make_request_cache(model, KVFormat(4, 64))
            return measure_prefill_peak(model, random_prompt(prompt_tokens, 512), chunk,
                                        first_token=False, cache=cache).peak_bytes

        peak = largest_peak(measure, estimate.total, TINY_MAX_RATIO_SHORT)
        assert 1.0 <= estimate.total / peak <= TINY_MAX_RATIO_SHORT, (
            f"{family} {prompt_tokens}/{chunk}: measured {peak / MIB:.2f} MiB, {estimate.describe()}")


def test_real_prefill_with_latent_attention():
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from benchmarks.estimator import measure_prefill_peak, random_prompt

    model_class, args_class = _get_classes(DEEPSEEK_V3)
    model = model_class(args_class.from_dict(DEEPSEEK_V3))
    mx.eval(model.parameters())
    for prompt_tokens, chunk in [(1000, 300), (2048, 2048)]:
        estimate = estimate_for_config(DEEPSEEK_V3, prompt_tokens, 0, chunk)
        peak = largest_peak(lambda: measure_prefill_peak(
            model, random_prompt(prompt_tokens, 512), chunk).peak_bytes, estimate.total, 1.25)
        # The latent formula counts both score matrices and the expanded K/V at once.
        assert 1.0 <= estimate.total / peak <= 1.25, estimate.describe()


@pytest.mark.slow
@pytest.mark.parametrize("prompt_tokens,chunk", [(512, 256), (1024, 512)])
def test_default_model_prefill_estimate(prompt_tokens, chunk):
    import json

    from mlx_lm import load

    from benchmarks.estimator import (
        TARGET_MAX_RATIO,
        activation_dtype_bytes,
        measure_prefill_peak,
        random_prompt,
    )
    from omlx_core.models.default import ensure_default_model

    path = ensure_default_model(progress=False)
    config = json.loads((path / "config.json").read_text())
    model = load(str(path))[0]
    prompt = random_prompt(prompt_tokens, config["vocab_size"])
    estimate = estimate_for_config(config, prompt_tokens, 0, chunk,
                                   dtype_bytes=activation_dtype_bytes(model))
    # A run whose CPU-stream worker kept up with dispatch reads low (1.156 once in a full
    # suite run, within 1.15 when repeated).
    peak = largest_peak(lambda: measure_prefill_peak(model, prompt, chunk).peak_bytes,
                        estimate.total, TARGET_MAX_RATIO)
    ratio = estimate.total / peak
    assert 1.0 <= ratio <= TARGET_MAX_RATIO, f"ratio {ratio:.3f}: {estimate.describe()}"
