"""The test model factory builds real, loadable, deterministic tiny models of each family."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import load_tokenizer

from omlx_core.testing import (
    CHAT_TEMPLATE,
    FAMILIES,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_model,
    build_tokenizer,
    cached_model,
    special_token_id,
)
from omlx_core.testing.pytest_fixtures import tiny_model_path  # noqa: F401  (fixture)
from omlx_core.testing.tokenizer import trained_tokenizer_json

GREEDY_TOKENS = 8
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
UTF8_SAMPLES = [
    "Crème brûlée in São Paulo, naïve façade, Zürich.",
    "你好，世界。今日はいい天気ですね。안녕하세요.",
    "Emoji: 😀🎉🚀 ❤️ 👍🏽 🧑‍💻 🤖",
    "Text never seen in training: Ωμέγα ẞ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \t\r\n end",
]


def load(path: Path):
    return mlx_lm.load(str(path))


def greedy_tokens(model, tokenizer) -> list[int]:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    steps = generate_step(mx.array(prompt), model, max_tokens=GREEDY_TOKENS)
    return [int(token) for token, _ in steps]


def cache_kinds(model) -> list[type]:
    return [type(cache) for cache in make_prompt_cache(model)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


def test_unknown_family_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        build_model("gpt5", tmp_path)
    for known in FAMILIES:
        assert known in str(excinfo.value)


def test_family_builds_loads_and_generates(family, tmp_path):
    path = build_model(family, tmp_path / family)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    model, tokenizer = load(path)

    tokens = greedy_tokens(model, tokenizer)
    assert len(tokens) == GREEDY_TOKENS
    assert all(0 <= t < FAMILIES[family]["vocab_size"] for t in tokens)
    # A model that only echoes one token would make every engine test trivially pass.
    assert len(set(tokens)) > 2, tokens


def test_loaded_weights_are_the_saved_weights(family, tmp_path):
    path = build_model(family, tmp_path / family)
    saved = mx.load(str(path / "model.safetensors"))
    model, _ = load(path)
    loaded = dict(tree_flatten(model.parameters()))
    assert set(loaded) == set(saved)
    for name, value in saved.items():
        assert mx.array_equal(loaded[name], value), name
    tied = FAMILIES[family]["tie_word_embeddings"]
    assert ("lm_head.weight" not in loaded) == tied


def test_same_seed_is_byte_identical_and_other_seeds_differ(family, tmp_path):
    first = build_model(family, tmp_path / "first", seed=7)
    again = build_model(family, tmp_path / "again", seed=7)
    other = build_model(family, tmp_path / "other", seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()

    first_tokens = greedy_tokens(*load(first))
    assert greedy_tokens(*load(again)) == first_tokens
    assert greedy_tokens(*load(other)) != first_tokens


def test_batched_greedy_matches_single_greedy(family, tmp_path):
    # Engine tests compare batched against single decoding; near-tied logits would flake.
    model, tokenizer = load(build_model(family, tmp_path))
    conversations = [MESSAGES, [{"role": "user", "content": "Hi"}]]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
    single = [
        [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=GREEDY_TOKENS)]
        for p in prompts
    ]
    batched = batch_generate(
        model, tokenizer, prompts, max_tokens=GREEDY_TOKENS, return_token_ids=True
    )
    assert [list(map(int, ids)) for ids in batched.token_ids] == single


def test_families_do_not_share_weights(tmp_path):
    embeddings = {
        family: mx.load(str(build_model(family, tmp_path / family) / "model.safetensors"))[
            "model.embed_tokens.weight"
        ]
        for family in ("llama", "qwen3")
    }
    assert not mx.array_equal(embeddings["llama"], embeddings["qwen3"])


def test_dense_families_use_a_kv_cache_per_layer(tmp_path):
    for family in ("llama", "qwen3"):
        model, _ = load(build_model(family, tmp_path / family))
        assert cache_kinds(model) == [KVCache] * FAMILIES[family]["num_hidden_layers"]


def test_gemma3_has_sliding_window_and_global_layers(tmp_path):
    config = FAMILIES["gemma3"]
    model, tokenizer = load(build_model("gemma3", tmp_path))
    caches = make_prompt_cache(model)
    assert {type(c) for c in caches} == {RotatingKVCache, KVCache}
    for index, cache in enumerate(caches):
        is_global = (index + 1) % config["sliding_window_pattern"] == 0
        if is_global:
            assert type(cache) is KVCache
        else:
            assert type(cache) is RotatingKVCache
            assert cache.max_size == config["sliding_window"]

    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert len(prompt) > config["sliding_window"], "the prompt must overflow the window"
    logits = model(mx.array(prompt)[None], cache=caches)
    model(mx.argmax(logits[:, -1:], axis=-1), cache=caches)
    mx.eval([c.keys for c in caches])
    assert all(c.offset == len(prompt) + 1 for c in caches)
    # After a decode step the sliding layers hold only the window; the global ones all.
    for cache in caches:
        if type(cache) is RotatingKVCache:
            assert cache.keys.shape[2] == config["sliding_window"]
        else:
            assert cache.keys.shape[2] >= len(prompt) + 1


def test_qwen3_next_is_hybrid_linear_and_full_attention(tmp_path):
    config = FAMILIES["qwen3_next"]
    model, tokenizer = load(build_model("qwen3_next", tmp_path))
    kinds = cache_kinds(model)
    interval = config["full_attention_interval"]
    layers = range(config["num_hidden_layers"])
    assert kinds == [KVCache if (i + 1) % interval == 0 else ArraysCache for i in layers]

    caches = make_prompt_cache(model)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    model(mx.array(prompt)[None], cache=caches)
    linear = [c for c in caches if isinstance(c, ArraysCache)]
    for cache in linear:
        conv_state, recurrent_state = cache.cache
        assert conv_state.shape[1] == config["linear_conv_kernel_dim"] - 1
        assert recurrent_state.shape[1] == config["linear_num_value_heads"]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_moe_families_have_expert_layers(family, tmp_path):
    config = FAMILIES[family]
    model, _ = load(build_model(family, tmp_path))
    for layer in model.layers:
        experts = layer.mlp.switch_mlp
        assert isinstance(experts, SwitchGLU)
        assert experts.gate_proj.weight.shape[0] == config["num_experts"]


def test_overrides_and_dtype_reach_the_loaded_model(tmp_path):
    path = build_model("llama", tmp_path, overrides={"num_hidden_layers": 3}, dtype="bfloat16")
    model, tokenizer = load(path)
    assert len(model.layers) == 3
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert len(greedy_tokens(model, tokenizer)) == GREEDY_TOKENS


def test_bad_arguments_say_what_to_use(tmp_path):
    with pytest.raises(ValueError, match="float32"):
        build_model("llama", tmp_path, dtype="int8")
    with pytest.raises(ValueError, match=f">= {VOCAB_SIZE}"):
        build_model("llama", tmp_path, overrides={"vocab_size": 100})


def test_tokenizer_trains_deterministically():
    assert trained_tokenizer_json.__wrapped__() == trained_tokenizer_json()


def test_tokenizer_round_trips_utf8_and_special_tokens(tmp_path):
    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer.get_vocab()) == VOCAB_SIZE
    for text in UTF8_SAMPLES:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        # The streaming detokenizer is what an engine uses to emit text.
        detokenizer = tokenizer.detokenizer
        assert isinstance(detokenizer, BPEStreamingDetokenizer)
        detokenizer.reset()
        for token in ids:
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text == text

    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token) == [special_token_id(token)]
        assert tokenizer.encode(f"a{token}b")[1] == special_token_id(token)
    assert tokenizer.eos_token_ids == {special_token_id("<|im_end|>")}
    assert tokenizer.bos_token is None
    assert tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_is_chatml(tmp_path):
    _, tokenizer = load(build_model("qwen3", tmp_path))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    text = tokenizer.apply_chat_template(with_system, add_generation_prompt=False, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids.count(special_token_id("<|im_start|>")) == 3
    assert ids.count(special_token_id("<|im_end|>")) == 2


def test_cached_model_builds_once_per_directory(tmp_path):
    path = cached_model("llama", cache_dir=tmp_path)
    built_at = (path / "model.safetensors").stat().st_mtime_ns
    assert cached_model("llama", cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == built_at
    assert cached_model("llama", seed=1, cache_dir=tmp_path) != path
    # Only finished models are left in the directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-seed0", "llama-seed1"]


def test_cached_model_without_a_directory_uses_a_process_temp_dir():
    path = cached_model("qwen3")
    assert path.is_dir() and cached_model("qwen3") == path


def test_tiny_model_path_fixture(tiny_model_path):  # noqa: F811
    path = tiny_model_path("gemma3")
    assert path == tiny_model_path("gemma3")
    assert (path / "model.safetensors").is_file()
    assert tiny_model_path("gemma3", seed=1) != path


def test_gpt_oss_alternates_sliding_and_full_layers_with_sinks_and_experts(tmp_path):
    config = FAMILIES["gpt_oss"]
    model, tokenizer = load(build_model("gpt_oss", tmp_path))
    kinds = cache_kinds(model)
    assert kinds == [RotatingKVCache if t == "sliding_attention" else KVCache
                     for t in config["layer_types"]]
    assert {RotatingKVCache, KVCache} == set(kinds)
    assert all(c.max_size == config["sliding_window"]
               for c in make_prompt_cache(model) if isinstance(c, RotatingKVCache))
    sinks = [layer.self_attn.sinks for layer in model.layers]
    # Drawn, not mlx-lm's zeros: the sinks differ per head and per layer.
    assert all(mx.any(s != 0).item() for s in sinks)
    assert not mx.array_equal(sinks[0], sinks[1])
    for layer in model.layers:
        assert isinstance(layer.mlp.experts, SwitchGLU)
        assert layer.mlp.experts.gate_proj.weight.shape[0] == config["num_local_experts"]
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert len(prompt) > config["sliding_window"], "the prompt must overflow the window"


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_next", "gpt_oss"])
def test_small_families_have_the_default_models_width_and_their_familys_layers(family):
    from omlx_core.testing import SMALL, family_config
    from omlx_core.testing.models import _model_classes

    config = family_config(family, SMALL[family])
    model_class, args_class = _model_classes(config)
    model = model_class(args_class.from_dict(config))  # weights stay lazy: nothing is drawn
    parameters = sum(value.size for _, value in tree_flatten(model.parameters()))
    assert 80e6 < parameters < 300e6 and config["hidden_size"] == 576
    kinds = {type(layer) for layer in make_prompt_cache(model)}
    assert kinds == {"llama": {KVCache}, "gemma3": {KVCache, RotatingKVCache},
                     "qwen3_next": {KVCache, ArraysCache},
                     "gpt_oss": {KVCache, RotatingKVCache}}[family]
    with pytest.raises(ValueError, match="sizes are tiny"):
        cached_model("qwen3", size="small")
