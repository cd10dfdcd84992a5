"""Tiny, seeded, random-weight models of several mlx-lm families, saved in mlx-lm format.

A model built here is a directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that loads through ``mlx_lm.load``
exactly like a converted checkpoint, so tests exercise the real loader, the real
model classes and their real cache types at a fraction of a megabyte.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

from omlx_core.testing.tokenizer import IM_END, VOCAB_SIZE, build_tokenizer, special_token_id

# Std of the normal init of the embedding (HF's usual initializer_range). Projections
# get 1/sqrt(fan_in) instead: with 0.02 everywhere the layers barely move the residual
# stream, and a tied-embedding model greedily repeats its last input token forever.
EMBEDDING_INIT_STD = 0.02

_SHARED_ATTENTION = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}

FAMILIES: dict[str, dict[str, Any]] = {
    # Plain dense transformer with a KVCache per layer (SmolLM2's architecture).
    "llama": {
        **_SHARED_ATTENTION,
        "model_type": "llama",
        "num_hidden_layers": 2,
        "rope_traditional": False,
        "tie_word_embeddings": True,
    },
    # Dense with q/k RMSNorm.
    "qwen3": {
        **_SHARED_ATTENTION,
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
    },
    # Layers alternate sliding-window (RotatingKVCache, window 16) and global (KVCache)
    # attention: layer i is global when (i + 1) % sliding_window_pattern == 0.
    # Tying is signalled to mlx-lm by leaving lm_head.weight out of the weights.
    "gemma3": {
        **_SHARED_ATTENTION,
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
        "tie_word_embeddings": True,
    },
    # Hybrid: GatedDeltaNet layers (ArraysCache of conv state + recurrent state) with a
    # full-attention layer every full_attention_interval layers, all with MoE MLPs,
    # like Qwen3-Next-80B-A3B (3 linear : 1 full). linear_key_head_dim is 32 so the
    # Metal gated-delta kernel, which needs a multiple of 32, is used on Apple GPUs.
    "qwen3_next": {
        **_SHARED_ATTENTION,
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    # gpt-oss: layers alternate sliding-window (RotatingKVCache, window 16) and full
    # attention, every attention has learned per-head sinks (a logit each head's softmax
    # adds to its denominator), and every MLP is a biased MoE with the clamped SwiGLU
    # (experts under mlp.experts, a biased router), like gpt-oss-20b.
    "gpt_oss": {
        **_SHARED_ATTENTION,
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    # Sparse MoE (SwitchGLU experts under mlp.switch_mlp in every layer), like Qwen3-30B-A3B.
    "qwen3_moe": {
        **_SHARED_ATTENTION,
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}

#: Overrides giving a family the default model's width (SmolLM2-135M: 576 wide, 9 query
#: heads and 3 KV heads of 64, an MLP of 1,536) at a depth near a real model's, and windows
#: and experts in the family's proportions. For benchmarks whose ratio must come from the
#: work a real model does: on a 64-wide model a turn's prefill costs next to nothing, and
#: fixed per-request costs make every ratio. 100-140M parameters each (float32: ~0.5 GB).
SMALL: dict[str, dict[str, Any]] = {
    family: {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
             "head_dim": 64, "intermediate_size": 1536, **extra}
    for family, extra in {
        "llama": {"num_hidden_layers": 30},
        # Gemma 3's 5 local : 1 global layers, a 512-token window (Gemma 3 1B's)
        "gemma3": {"num_hidden_layers": 30, "query_pre_attn_scalar": 64,
                   "sliding_window": 512, "sliding_window_pattern": 6},
        # 3 GatedDeltaNet : 1 attention layer, 8 experts (2 routed per token) + a shared one
        "qwen3_next": {"num_hidden_layers": 24, "linear_num_key_heads": 4,
                       "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                       "linear_value_head_dim": 64, "num_experts": 8,
                       "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
        # alternating 128-token windows (gpt-oss's) and full layers, 8 experts of 768
        "gpt_oss": {"num_hidden_layers": 24, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12,
                    "num_local_experts": 8, "intermediate_size": 768},
    }.items()
}

DTYPES = ("float32", "float16", "bfloat16")


def family_config(family: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` contents of ``family`` with ``overrides`` applied."""
    if family not in FAMILIES:
        raise ValueError(
            f"unknown test model family {family!r}; known families: {', '.join(sorted(FAMILIES))}"
        )
    config = copy.deepcopy(FAMILIES[family])
    config.update(copy.deepcopy(overrides or {}))
    if config["vocab_size"] < VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {config['vocab_size']} is smaller than the test tokenizer's "
            f"{VOCAB_SIZE} tokens; use vocab_size >= {VOCAB_SIZE} (larger pads the vocabulary)"
        )
    config["eos_token_id"] = special_token_id(IM_END)
    return config


def _model_classes(config: dict[str, Any]) -> tuple[type, type]:
    from omlx_core.models.loader import model_classes

    return model_classes(config)


def _is_projection(module: Any) -> bool:
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    return isinstance(module, (nn.Linear, nn.Embedding, SwitchLinear))


def build_weights(family: str, *, seed: int = 0, overrides: dict[str, Any] | None = None,
                  dtype: str = "float32") -> tuple[dict[str, Any], dict[str, Any]]:
    """The (weights, config) of a tiny ``family`` model, weights named as mlx-lm loads them.

    Reseeds mlx's global random generator (from ``family`` and ``seed``): the model
    classes draw their own init (e.g. GatedDeltaNet's ``A_log``) from it.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    config = family_config(family, overrides)
    model_class, args_class = _model_classes(config)

    # The family is folded into the seed so two families never share a weight tensor.
    family_seed = zlib.crc32(f"{family}/{seed}".encode())
    mx.random.seed(family_seed)
    model = model_class(args_class.from_dict(config))
    # Embeddings and projections are redrawn from normals with an explicit key; norms,
    # convolutions and the recurrent parameters keep the model's own (seeded) init.
    projections = sorted(
        (name, module) for name, module in model.named_modules() if _is_projection(module)
    )
    keys = mx.random.split(mx.random.key(family_seed), len(projections))
    params = dict(tree_flatten(model.parameters()))
    for (name, module), subkey in zip(projections, keys):
        shape = params[f"{name}.weight"].shape
        std = EMBEDDING_INIT_STD if isinstance(module, nn.Embedding) else shape[-1] ** -0.5
        params[f"{name}.weight"] = mx.random.normal(shape, scale=std, key=subkey)
    # mlx-lm starts attention sinks at zero (every head the same); drawn, they differ per
    # head and layer, so a sink that is dropped or misplaced changes the outputs.
    sinks = sorted(name for name in params if name.endswith(".sinks"))
    for name, subkey in zip(sinks, mx.random.split(mx.random.key(family_seed + 1), len(sinks) or 1)):
        params[name] = mx.random.normal(params[name].shape, key=subkey)

    target_dtype = getattr(mx, dtype)
    weights = {
        name: value.astype(target_dtype) if mx.issubdtype(value.dtype, mx.floating) else value
        for name, value in sorted(params.items())
    }
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    mx.eval(weights)

    if hasattr(model, "sanitize"):
        sanitized = model.sanitize(dict(weights))
        if set(sanitized) != set(weights):
            raise RuntimeError(
                f"mlx-lm's {config['model_type']} sanitize() renames or drops weights the "
                f"factory saves (changed: {sorted(set(sanitized) ^ set(weights))}); the "
                "installed mlx-lm expects a different layout: update FAMILIES/build_weights"
            )
    return weights, config


def build_model(family: str, out_dir: Path, *, seed: int = 0,
                overrides: dict[str, Any] | None = None, dtype: str = "float32") -> Path:
    """Build a tiny ``family`` model into ``out_dir`` (created) and return ``out_dir``.

    The same family, seed, overrides and dtype give byte-identical files.
    """
    import mlx.core as mx

    weights, config = build_weights(family, seed=seed, overrides=overrides, dtype=dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    build_tokenizer(out_dir)
    return out_dir


_cache_lock = threading.Lock()
_cached_paths: dict[tuple[str, int, str], Path] = {}
_default_cache_dir: tempfile.TemporaryDirectory | None = None


def cached_build(name: str, build: Callable[[Path], Any], seed: int,
                 cache_dir: Path | None) -> Path:
    """Path of the model ``build(directory)`` writes, built once per process as
    ``<cache_dir>/<name>-seed<seed>``.

    Built under ``cache_dir`` when given, else under a temporary directory removed at
    interpreter exit. A directory left by another process is rebuilt, never trusted.
    """
    global _default_cache_dir
    with _cache_lock:
        if cache_dir is None:
            if _default_cache_dir is None:
                _default_cache_dir = tempfile.TemporaryDirectory(prefix="omlx-test-models-")
            cache_dir = Path(_default_cache_dir.name)
        cache_key = (name, seed, str(Path(cache_dir).resolve()))
        if cache_key in _cached_paths:
            return _cached_paths[cache_key]
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        target = Path(cache_dir) / f"{name}-seed{seed}"
        # Build beside the target and swap it in, so a reader never sees half a model.
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-seed{seed}-", dir=cache_dir))
        try:
            build(staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _cached_paths[cache_key] = target
        return target


def cached_model(family: str, seed: int = 0, *, cache_dir: Path | None = None,
                 size: str = "tiny") -> Path:
    """Path of a ``family`` model built once per process (float32), tiny or with the
    :data:`SMALL` overrides (``size="small"``); see :func:`cached_build`."""
    if size not in ("tiny", "small") or (size == "small" and family not in SMALL):
        raise ValueError(f"size {size!r} of {family!r}: sizes are tiny (every family) and "
                         f"small ({', '.join(sorted(SMALL))})")
    overrides = SMALL[family] if size == "small" else None
    name = family if size == "tiny" else f"{family}-small"
    return cached_build(name, lambda directory: build_model(family, directory, seed=seed,
                                                            overrides=overrides),
                        seed, cache_dir)


def routed_modules(model: Any, name: str, mark: str) -> set[str]:
    """The names of ``model``'s family modules whose global ``name`` is a route marked
    with ``mark`` (see :func:`omlx_core.models.attention.install_route`)."""
    modules = [sys.modules[type(layer).__module__] for _, layer in model.named_modules()]
    return {m.__name__ for m in modules if getattr(getattr(m, name, None), mark, False)}


def greedy_after_chunked_prefill(model: Any, prompt: Any, *, chunk: int = 30,
                                 steps: int = 12) -> tuple[Any, list[int]]:
    """Prefill ``prompt`` (1, length) in chunks, then decode ``steps`` greedy tokens: the
    prefill's logits (concatenated) and the tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    length = prompt.shape[1]
    logits = [model(prompt[:, start:start + chunk], cache=cache) for start in range(0, length, chunk)]
    token, tokens = mx.argmax(logits[-1][:, -1], axis=-1), []
    for _ in range(steps):
        tokens.append(token.item())
        token = mx.argmax(model(token[None], cache=cache)[:, -1], axis=-1)
    return mx.concatenate(logits, axis=1), tokens
