"""Convert a llama-architecture GGUF file into an mlx-lm model directory."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from omlx_core.models.errors import ModelError

__all__ = [
    "CONVERTER_VERSION",
    "CONVERSION_MARKER",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_DTYPES",
    "GGUFConversionError",
    "convert_gguf",
    "read_gguf",
    "config_from_metadata",
    "hf_tensor_name",
    "tokenizer_from_metadata",
    "tokenizer_config_from_metadata",
    "conversion_is_current",
    "read_conversion_marker",
    "file_sha256",
]

# Bump when the output of a conversion changes, so cached conversions are redone.
CONVERTER_VERSION = 1
CONVERSION_MARKER = "omlx_conversion.json"
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "keep")

# mlx's GGUF reader unpacks Q4_0, Q4_1 and Q8_0 blocks of 32 values into affine
# (weight, scales, biases) triples; every other GGUF quantization arrives as float16.
GGUF_GROUP_SIZE = 32

_FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# "bias" is a real bias vector; "scales"/"biases" are mlx's affine quantization parts.
_TENSOR_SUFFIXES = ("weight", "bias", "scales", "biases")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)")

# GPT-2's split regex, which the tokenizers ByteLevel pre-tokenizer applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` names, grouped by the regex chain llama.cpp applies.
_PRE_TOKENIZER_FAMILIES = {
    "gpt2": ("gpt-2", "phi-2", "roberta-bpe"),
    "digits+gpt2": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    "llama3": ("llama-bpe", "llama3", "smaug-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "megrez"),
}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class GGUFConversionError(ModelError, ValueError):
    """A GGUF file that this converter cannot turn into an mlx-lm model."""


def read_gguf(gguf_path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read all tensors and metadata of a GGUF file with mlx."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    try:
        tensors, metadata = mx.load(str(gguf_path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError) as error:
        raise GGUFConversionError(f"{gguf_path} could not be read as GGUF: {error}") from error
    return tensors, metadata


def _value(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata entry as a plain Python value (mlx stores numbers as arrays)."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        if value.ndim != 0:
            raise GGUFConversionError(
                f"metadata {key!r} is a per-layer array {value.shape}; only uniform layers are supported"
            )
        return value.item()
    return value


def _float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (GGUF stores float32)."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


def _required(metadata: dict[str, Any], key: str) -> Any:
    value = _value(metadata, key)
    if value is None:
        raise GGUFConversionError(f"GGUF metadata lacks {key!r}, which a llama model needs")
    return value


def _architecture(metadata: dict[str, Any]) -> str:
    architecture = _value(metadata, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"GGUF architecture {architecture!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def hf_tensor_name(gguf_name: str) -> str:
    """The mlx-lm (Hugging Face llama) parameter name for a GGUF tensor name."""
    module, _, suffix = gguf_name.rpartition(".")
    if suffix not in _TENSOR_SUFFIXES:
        raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r}: unexpected suffix {suffix!r}")
    if module in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[module]}.{suffix}"
    match = _LAYER_NAME.fullmatch(module)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.{suffix}"
    if module == "rope_freqs":
        raise GGUFConversionError(
            "GGUF tensor 'rope_freqs.weight' (llama 3.1-style RoPE frequency factors) is not supported"
        )
    known = ", ".join([*_GLOBAL_TENSORS, *(f"blk.N.{name}" for name in _LAYER_TENSORS)])
    raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r} for a llama model; known tensors: {known}")


def config_from_metadata(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """The mlx-lm `config.json` for a llama GGUF's metadata and tensors."""
    arch = _architecture(metadata)
    if (_value(metadata, f"{arch}.expert_count") or 0) > 0:
        raise GGUFConversionError("mixture-of-experts llama GGUFs (llama.expert_count > 0) are not supported")

    hidden_size = int(_required(metadata, f"{arch}.embedding_length"))
    num_heads = int(_required(metadata, f"{arch}.attention.head_count"))
    num_kv_heads = int(_value(metadata, f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(_value(metadata, f"{arch}.attention.key_length", hidden_size // num_heads))
    value_dim = int(_value(metadata, f"{arch}.attention.value_length", head_dim))
    rope_dims = int(_value(metadata, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise GGUFConversionError(f"key length {head_dim} != value length {value_dim} is not supported")
    if rope_dims != head_dim:
        raise GGUFConversionError(f"partial RoPE ({rope_dims} of {head_dim} head dims) is not supported")

    embedding_rows = _logical_shape(tensors, "token_embd")[0]
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": int(_required(metadata, f"{arch}.block_count")),
        "intermediate_size": int(_required(metadata, f"{arch}.feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float32(_required(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_value(metadata, f"{arch}.rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes Q/K rows so that RoPE rotates interleaved pairs.
        "rope_traditional": True,
        "vocab_size": embedding_rows,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(f"blk.0.attn_{p}.bias" in tensors for p in ("q", "k", "v", "output")),
        "mlp_bias": any(f"blk.0.ffn_{p}.bias" in tensors for p in ("gate", "up", "down")),
    }
    context_length = _value(metadata, f"{arch}.context_length")
    if context_length is not None:
        config["max_position_embeddings"] = int(context_length)

    scaling_type = _value(metadata, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        factor = _float32(_required(metadata, f"{arch}.rope.scaling.factor"))
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling_type != "none":
        raise GGUFConversionError(f"RoPE scaling {scaling_type!r} is not supported; supported: none, linear")

    for name, key in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        token_id = _value(metadata, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[name] = int(token_id)
    stop_ids = [
        int(token_id)
        for key in ("eos", "eot")
        if (token_id := _value(metadata, f"tokenizer.ggml.{key}_token_id")) is not None
    ]
    if stop_ids:
        unique = list(dict.fromkeys(stop_ids))
        config["eos_token_id"] = unique[0] if len(unique) == 1 else unique
    return config


def _logical_shape(tensors: dict[str, mx.array], module: str) -> tuple[int, ...]:
    """The unquantized (out, in) shape of a module's weight."""
    weight = tensors[f"{module}.weight"]
    scales = tensors.get(f"{module}.scales")
    if scales is None:
        return tuple(weight.shape)
    return (*weight.shape[:-1], scales.shape[-1] * GGUF_GROUP_SIZE)


def _quantized_bits(tensors: dict[str, mx.array], module: str) -> int:
    weight, scales = tensors[f"{module}.weight"], tensors[f"{module}.scales"]
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits, remainder = divmod(weight.shape[-1] * 32, in_features)
    if remainder or bits not in (2, 3, 4, 5, 6, 8) or weight.dtype != mx.uint32:
        raise GGUFConversionError(
            f"GGUF tensor {module!r} has an unexpected quantized layout "
            f"(weight {weight.dtype} {weight.shape}, scales {scales.shape})"
        )
    return bits


def _convert_module(
    tensors: dict[str, mx.array], module: str, dtype: str
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """One GGUF module's tensors under mlx-lm names, and its quantization if kept."""
    hf_module = hf_tensor_name(f"{module}.weight").rpartition(".")[0]
    weight = tensors[f"{module}.weight"]
    quantization = None
    if f"{module}.scales" in tensors:
        bits = _quantized_bits(tensors, module)
        # float32 scales are lossless (GGUF stores float16) and keep mlx's CPU quantized
        # matmul out of float16 accumulation, which derails greedy decoding of SmolLM2.
        scales = tensors[f"{module}.scales"].astype(mx.float32)
        biases = tensors[f"{module}.biases"].astype(mx.float32)
        if dtype == "keep":
            converted = {"weight": weight, "scales": scales, "biases": biases}
            quantization = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
        else:
            # Dequantizing in float32 computes what llama.cpp computes: d * q + m in float32.
            weight = mx.dequantize(weight, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)
            converted = {"weight": weight.astype(_FLOAT_DTYPES[dtype])}
    else:
        converted = {"weight": weight.astype(_FLOAT_DTYPES.get(dtype, mx.float32))}
    if f"{module}.bias" in tensors:
        converted["bias"] = tensors[f"{module}.bias"].astype(_FLOAT_DTYPES.get(dtype, mx.float32))
    return {f"{hf_module}.{part}": array for part, array in converted.items()}, quantization


def _check_against_mlx_lm(config: dict[str, Any], logical_shapes: dict[str, tuple[int, ...]]) -> None:
    """Compare converted shapes with an (unevaluated) mlx-lm llama built from `config`."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    expected = {name: tuple(array.shape) for name, array in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(logical_shapes))
    unexpected = sorted(set(logical_shapes) - set(expected))
    wrong = [
        f"{name} {logical_shapes[name]} (mlx-lm expects {expected[name]})"
        for name in sorted(set(expected) & set(logical_shapes))
        if logical_shapes[name] != expected[name]
    ]
    if missing or unexpected or wrong:
        problems = []
        if missing:
            problems.append(f"missing tensors: {', '.join(missing[:8])}")
        if unexpected:
            problems.append(f"unexpected tensors: {', '.join(unexpected[:8])}")
        if wrong:
            problems.append(f"wrong shapes: {'; '.join(wrong[:8])}")
        raise GGUFConversionError("GGUF tensors do not match its llama metadata: " + " | ".join(problems))


def _modules(tensors: dict[str, mx.array]) -> list[str]:
    for name in tensors:
        hf_tensor_name(name)
    modules = sorted({name.rpartition(".")[0] for name in tensors})
    for module in modules:
        if f"{module}.weight" not in tensors:
            raise GGUFConversionError(f"GGUF module {module!r} has no weight tensor")
    return modules


def _convert_weights(
    tensors: dict[str, mx.array], config: dict[str, Any], dtype: str, progress: bool
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    modules = _modules(tensors)
    logical_shapes = {hf_tensor_name(f"{m}.weight"): _logical_shape(tensors, m) for m in modules}
    logical_shapes |= {
        hf_tensor_name(f"{m}.bias"): tuple(tensors[f"{m}.bias"].shape) for m in modules if f"{m}.bias" in tensors
    }
    _check_against_mlx_lm(config, logical_shapes)
    weights: dict[str, mx.array] = {}
    per_module: dict[str, dict[str, Any] | bool] = {}
    for module in tqdm(modules, desc="Converting GGUF", unit="tensor", disable=not progress):
        converted, quantization = _convert_module(tensors, module, dtype)
        mx.eval(converted)
        weights.update(converted)
        hf_module = hf_tensor_name(f"{module}.weight").rpartition(".")[0]
        if quantization is not None:
            per_module[hf_module] = quantization
        elif tensors[f"{module}.weight"].ndim == 2:
            per_module[hf_module] = False
    return weights, _quantization_config(per_module)


def _quantization_config(per_module: dict[str, dict[str, Any] | bool]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: the commonest setting, plus per-layer exceptions."""
    settings = [json.dumps(q, sort_keys=True) for q in per_module.values() if q]
    if not settings:
        return None
    default = json.loads(Counter(settings).most_common(1)[0][0])
    config: dict[str, Any] = dict(default)
    config.update({module: q for module, q in per_module.items() if q != default})
    return config


def tokenizer_from_metadata(metadata: dict[str, Any]):
    """A Hugging Face `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer_model = _value(metadata, "tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise GGUFConversionError(
            f"GGUF tokenizer model {tokenizer_model!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise GGUFConversionError("GGUF tokenizer merges must each be two tokens separated by one space")
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # A BPE vocabulary maps each string to one id; llama.cpp keeps the first on duplicates too.
        vocab.setdefault(token, token_id)

    unknown_id = _value(metadata, "tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unknown_id] if unknown_id is not None else None,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(_value(metadata, "tokenizer.ggml.pre", "gpt-2"), pre_tokenizers)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens, processors)

    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else [1] * len(tokens)
    tokenizer.add_tokens(
        [
            AddedToken(token, special=token_type == _TOKEN_TYPE_CONTROL, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
    )
    return tokenizer


def _pre_tokenizer(pre: str, pre_tokenizers):
    family = next((name for name, members in _PRE_TOKENIZER_FAMILIES.items() if pre in members), None)
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if family in ("llama3", "qwen2"):
        from tokenizers import Regex

        pattern = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = ", ".join(name for members in _PRE_TOKENIZER_FAMILIES.values() for name in members)
    raise GGUFConversionError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {supported}")


def _post_processor(metadata: dict[str, Any], tokens: list[str], processors):
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = _value(metadata, "tokenizer.ggml.bos_token_id")
    eos_id = _value(metadata, "tokenizer.ggml.eos_token_id")
    prefix = [tokens[bos_id]] if _value(metadata, "tokenizer.ggml.add_bos_token") and bos_id is not None else []
    suffix = [tokens[eos_id]] if _value(metadata, "tokenizer.ggml.add_eos_token") and eos_id is not None else []
    if not prefix and not suffix:
        return byte_level
    template = processors.TemplateProcessing(
        single=" ".join([*prefix, "$A", *suffix]),
        pair=" ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix]),
        special_tokens=[(token, tokens.index(token)) for token in dict.fromkeys(prefix + suffix)],
    )
    return processors.Sequence([byte_level, template])


def tokenizer_config_from_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer_config.json` for a GGUF's tokenizer metadata."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_value(metadata, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_value(metadata, "tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        token_id = _value(metadata, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[name] = tokens[token_id]
    context_length = _value(metadata, f"{_value(metadata, 'general.architecture')}.context_length")
    if context_length is not None:
        config["model_max_length"] = int(context_length)
    chat_template = _value(metadata, "tokenizer.chat_template")
    if chat_template:
        config["chat_template"] = chat_template
    return config


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _marker(gguf_path: Path, dtype: str) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path.resolve()),
        "source_sha256": file_sha256(gguf_path),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "dtype": dtype,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def read_conversion_marker(model_dir: Path) -> dict[str, Any] | None:
    """The conversion record of a converted model directory, or None."""
    try:
        return json.loads((Path(model_dir) / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return None


def conversion_is_current(model_dir: Path, gguf_path: Path, dtype: str) -> bool:
    """Whether `model_dir` holds this converter's conversion of this exact GGUF file at `dtype`.

    Size and mtime decide quickly; when only the mtime differs the file is hashed.
    """
    marker = read_conversion_marker(model_dir)
    if not marker or not (Path(model_dir) / "config.json").is_file():
        return False
    stat = Path(gguf_path).stat()
    if (marker.get("converter_version"), marker.get("dtype"), marker.get("source_size")) != (
        CONVERTER_VERSION,
        dtype,
        stat.st_size,
    ):
        return False
    if marker.get("source_mtime_ns") == stat.st_mtime_ns:
        return True
    return marker.get("source_sha256") == file_sha256(Path(gguf_path))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_weights(path: Path, weights: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _install(staging_dir: Path, out_dir: Path) -> None:
    """Move a finished conversion into place, replacing an earlier conversion."""
    if not out_dir.exists():
        os.replace(staging_dir, out_dir)
        return
    if not (out_dir / CONVERSION_MARKER).is_file() and any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} exists and is not a converted model; choose an empty or new output directory"
        )
    retired = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
    os.replace(out_dir, retired / "model")
    os.replace(staging_dir, out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str = "float32", progress: bool = True) -> Path:
    """Convert a llama GGUF into an mlx-lm model directory and return that directory.

    `dtype` "float32"/"float16"/"bfloat16" dequantizes every weight to that type;
    "keep" keeps Q4_0/Q4_1/Q8_0 weights as mlx affine quantized layers (bits per
    layer recorded in config `quantization`), with float32 scales and float32
    unquantized tensors. The directory appears complete or not at all: it is built next to
    `out_dir` and renamed into place. An existing earlier conversion is replaced;
    any other non-empty `out_dir` is refused.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
    tensors, metadata = read_gguf(gguf_path)
    config = config_from_metadata(metadata, tensors)
    tokenizer = tokenizer_from_metadata(metadata)
    tokenizer_config = tokenizer_config_from_metadata(metadata)
    weights, quantization = _convert_weights(tensors, config, dtype, progress)
    del tensors
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        _save_weights(staging_dir / "model.safetensors", weights)
        del weights
        _write_json(staging_dir / "config.json", config)
        tokenizer.save(str(staging_dir / "tokenizer.json"))
        _write_json(staging_dir / "tokenizer_config.json", tokenizer_config)
        # Written last: its presence means the directory is complete.
        _write_json(staging_dir / CONVERSION_MARKER, _marker(gguf_path, dtype))
        _install(staging_dir, out_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    return out_dir
