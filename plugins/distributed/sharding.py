"""Which part of a model each rank holds, checked before any weight is read.

Tensor parallel (``model.shard(group)``, mlx-lm's): every layer's attention heads and
MLP columns split over the ranks; each rank holds ``1/N`` of the layers' weights and of
the KV cache, and every forward all-sums twice per layer. Pipeline
(``model.model.pipeline(group)``): each rank holds a contiguous run of layers (their
weights and KV) and hands activations on. The embeddings and the head stay whole on
every rank either way. Loading is lazy, so each rank reads only the slices it keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omlx_core.scheduling import ModelError

MODES = ("tensor", "pipeline")


class ShardingError(ModelError):
    """The model cannot be split the way asked; the message says what would work."""


def check_sharding(model: Any, config: Mapping[str, Any], mode: str, size: int) -> None:
    """Refuse a split the model cannot take, naming one that it can."""
    model_type = config.get("model_type", "?")
    tensor_ok = hasattr(model, "shard")
    pipeline_ok = hasattr(getattr(model, "model", None), "pipeline")
    if mode not in MODES:
        raise ShardingError(f"--distributed {mode!r}: use one of {', '.join(MODES)}")
    if mode == "tensor" and not tensor_ok:
        raise ShardingError(
            f"model_type {model_type!r} has no tensor-parallel split in mlx-lm (no shard())"
            + ("; use --distributed pipeline" if pipeline_ok else "; nor a pipeline split: "
               "serve it on one machine"))
    if mode == "pipeline" and not pipeline_ok:
        raise ShardingError(
            f"model_type {model_type!r} has no pipeline split in mlx-lm (no model.pipeline())"
            + ("; use --distributed tensor" if tensor_ok else "; nor a tensor-parallel split: "
               "serve it on one machine"))
    if mode == "tensor" and size > 1:
        heads = _int(config, "num_attention_heads")
        kv_heads = _int(config, "num_key_value_heads") or heads
        if heads and (heads % size or kv_heads % size):
            fits = [n for n in range(2, heads + 1) if heads % n == 0 and kv_heads % n == 0]
            hint = (f"use {' or '.join(map(str, fits[:3]))} ranks" if fits
                    else "no rank count above 1 divides both")
            raise ShardingError(
                f"{heads} attention heads, {kv_heads} KV heads do not divide by {size} ranks: "
                f"{hint}, or --distributed pipeline" + ("" if pipeline_ok else
                                                         " (which model_type "
                                                         f"{model_type!r} does not have)"))
    if mode == "pipeline" and size > 1:
        layers = _int(config, "num_hidden_layers")
        if layers and layers < size:
            raise ShardingError(f"{layers} layers cannot be split over {size} ranks: use at most "
                                f"{layers} ranks")


def _int(config: Mapping[str, Any], key: str) -> int:
    for table in (config, config.get("text_config") or {}):
        value = table.get(key)
        if isinstance(value, int):
            return value
    return 0


def load_sharded(path: Path | str, mode: str, group: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` with this rank's part of the weights only."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    from omlx_core.scheduling import install_cpu_routes, settle_random_state

    path = Path(path)
    model, config = load_model(path, lazy=True, strict=False)
    check_sharding(model, config, mode, group.size())
    # No trust_remote_code: a model directory's Python is not run, on any rank.
    tokenizer = load_tokenizer(path, {}, eos_token_ids=config.get("eos_token_id", None))
    if group.size() > 1:
        if mode == "tensor":
            model.shard(group)
        else:
            model.model.pipeline(group)
    mx.eval(model.parameters())
    settle_random_state()
    install_cpu_routes(model)  # every rank takes the same routes: the same numbers
    return model, tokenizer


def held_fraction(mode: str, size: int) -> float:
    """The share of the layers' weights and KV one rank holds."""
    return 1.0 / max(1, size)
