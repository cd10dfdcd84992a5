"""Loads a model directory into memory: the one path real and test models both take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omlx_core.models.registry import ModelError


def load_model(path: Path | str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an mlx-lm directory; the tokenizer is mlx-lm's wrapper.

    The model's attention and SwiGLU take :mod:`omlx_core.models.attention`'s and
    :mod:`omlx_core.models.mlp_route`'s routes: on the CPU backend a prefill chunk's
    softmax and SiLU run on the vector units; everywhere else they are mlx-lm's own.
    """
    from mlx_lm import load

    from omlx_core.models.tokenizer_json import read_tokenizer_json

    read_tokenizer_json()
    try:
        model, tokenizer = load(str(path))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load model from {path}: {type(exc).__name__}: {exc}") from exc
    settle_random_state()
    install_cpu_routes(model)
    return model, tokenizer


def install_cpu_routes(model: Any) -> None:
    """Put a loaded model's attention, SwiGLU, RMS norms, rotary embeddings and float32
    linear layers on the CPU routes and kernels (each does nothing off the CPU backend or
    where it does not apply): :mod:`~omlx_core.models.attention`,
    :mod:`~omlx_core.models.mlp_route`, :mod:`~omlx_core.models.layer_kernels`,
    :mod:`~omlx_core.models.packed_linear`."""
    from omlx_core.models.attention import install_cpu_attention, install_kv_rotation
    from omlx_core.models.layer_kernels import install_cpu_layer_kernels
    from omlx_core.models.mlp_route import install_cpu_swiglu
    from omlx_core.models.packed_linear import install_packed_linears

    install_cpu_attention(model)
    install_kv_rotation(model)  # a quantized KV cache is read rotated on every model
    install_cpu_swiglu(model)
    install_cpu_layer_kernels(model)
    install_packed_linears(model)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer behind ``tokenizer`` (an mlx-lm ``TokenizerWrapper``,
    which xgrammar does not know, or a Hugging Face tokenizer itself)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        return tokenizer
    # The wrapper forwards attributes to the tokenizer it wraps and has no public name
    # for it: a forwarded bound method's ``__self__`` is that tokenizer.
    return tokenizer.convert_tokens_to_ids.__self__


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """``(Model, ModelArgs)``: the mlx-lm classes that build a model of ``config``
    (its ``model_type``, remapped as mlx-lm remaps it)."""
    import importlib

    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    remapped = next((MODEL_ARCHITECTURE_REMAPPING[(model_type, a)] for a in architectures
                     if (model_type, a) in MODEL_ARCHITECTURE_REMAPPING), None)
    module_name = remapped or MODEL_REMAPPING.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{module_name}")
    except ImportError as exc:
        raise ModelError(f"model type {model_type!r} is not one mlx-lm builds") from exc
    return module.Model, module.ModelArgs


def settle_random_state() -> None:
    """Evaluate mlx's global random key after building a model (call it once per load).

    A model's layers are created with lazily initialised random weights that loading
    then replaces unevaluated; each draw split the global key, so the key is left as an
    unevaluated chain of one split per layer, on top of the previous load's chain. Each
    load/unload cycle of the default model kept ~0.45 MB this way (issue 20: twenty
    cycles must stay within 5 % of one model's bytes); evaluating the key drops it.
    """
    import mlx.core as mx

    mx.eval(mx.random.state)


def activation_dtype_bytes(model: Any) -> int:
    """Bytes per element of the model's activations: its most common float parameter dtype."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    counts: dict[Any, int] = {}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            counts[value.dtype] = counts.get(value.dtype, 0) + value.size
    if not counts:
        raise ValueError("model has no floating-point parameters to take the activation dtype from")
    return max(counts, key=lambda dtype: counts[dtype]).size
