"""Tiny, seeded, random-weight vision-language models in mlx-vlm's format.

A model built here is a directory laid out like a converted mlx-vlm checkpoint
(``config.json`` with nested ``text_config`` / ``vision_config``,
``model.safetensors``, ``preprocessor_config.json``, a tokenizer with the family's
image tokens and a chat template that renders ``{"type": "image"}`` parts), so
``mlx_vlm.utils.load_model`` and transformers' image processors load it exactly as
they load a real one. Families:

``llava``
    a CLIP vision tower, a two-layer projector and a llama language model; each image
    is ``(image_size / patch_size) ** 2`` ``<image>`` tokens.
``gemma3``
    a SigLIP vision tower average-pooled to ``mm_tokens_per_image`` soft tokens and a
    gemma3 language model (sliding-window and global layers).
"""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path
from typing import Any

from omlx_core.testing.models import EMBEDDING_INIT_STD, cached_build
from omlx_core.testing.tokenizer import (
    DEFAULT_SYSTEM_PROMPT,
    IM_END,
    VOCAB_SIZE,
    special_token_id,
    tokenizer_config,
    trained_tokenizer_json,
)

#: the text model's vocabulary: the test tokenizer's tokens, the family's image tokens
#: after them, padded to a round size
VLM_VOCAB_SIZE = 520

#: the image side every tiny family takes, in pixels
IMAGE_SIZE = 56
PATCH_SIZE = 14

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

VLM_FAMILIES: dict[str, dict[str, Any]] = {
    "llava": {
        # what the chat template writes for an image part, and the tokens it adds
        "image_tokens": ["<image>"],
        "placeholder": "<image>",
        "config": {
            "model_type": "llava",
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "text_config": {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": False,
            },
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "num_hidden_layers": 3,
                "image_size": IMAGE_SIZE,
                "patch_size": PATCH_SIZE,
                "projection_dim": 32,
                "layer_norm_eps": 1e-5,
            },
        },
        "preprocessor": {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": IMAGE_SIZE},
            "do_center_crop": True,
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": _CLIP_MEAN,
            "image_std": _CLIP_STD,
            "do_convert_rgb": True,
            "resample": 3,
        },
    },
    "gemma3": {
        "image_tokens": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
        "placeholder": "<start_of_image>",
        "config": {
            "model_type": "gemma3",
            "mm_tokens_per_image": 4,
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "rope_global_base_freq": 1000000.0,
                "rope_local_base_freq": 10000.0,
                "sliding_window": 16,
                "sliding_window_pattern": 2,
                # as in Gemma 3 4B and up: global layers' RoPE scaled, sliding ones not
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "mm_tokens_per_image": 4,
                "max_position_embeddings": 4096,
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "num_hidden_layers": 3,
                "image_size": IMAGE_SIZE,
                "patch_size": PATCH_SIZE,
                "layer_norm_eps": 1e-6,
            },
        },
        "preprocessor": {
            "image_processor_type": "Gemma3ImageProcessor",
            "do_resize": True,
            "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "do_pan_and_scan": False,
            "resample": 2,
        },
    },
}


def _chat_template(placeholder: str) -> str:
    """ChatML (the test tokenizer's) that also renders a list of text and image parts."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n' }}"
        "{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + placeholder + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def _tokenizer_files(image_tokens: list[str], placeholder: str) -> tuple[str, dict[str, Any]]:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(trained_tokenizer_json())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in image_tokens])
    config = tokenizer_config()
    config["additional_special_tokens"] = list(config["additional_special_tokens"]) + image_tokens
    config["chat_template"] = _chat_template(placeholder)
    return tokenizer.to_str(), config


def vlm_family_config(family: str, image_size: int = IMAGE_SIZE) -> dict[str, Any]:
    """The ``config.json`` contents of ``family`` (image token ids filled in), its
    vision tower taking ``image_size``-pixel images (a multiple of the patch size)."""
    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown test VLM family {family!r}; known families: "
                         f"{', '.join(sorted(VLM_FAMILIES))}")
    spec = VLM_FAMILIES[family]
    config = copy.deepcopy(spec["config"])
    ids = {token: VOCAB_SIZE + i for i, token in enumerate(spec["image_tokens"])}
    if image_size % PATCH_SIZE:
        raise ValueError(f"image_size must be a multiple of the patch size {PATCH_SIZE}, not {image_size}")
    config["vision_config"]["image_size"] = image_size
    config["text_config"]["vocab_size"] = VLM_VOCAB_SIZE
    config["vocab_size"] = VLM_VOCAB_SIZE
    config["eos_token_id"] = special_token_id(IM_END)
    if family == "llava":
        config["image_token_index"] = ids["<image>"]
    else:
        config["image_token_index"] = ids["<image_soft_token>"]
        config["boi_token_index"] = ids["<start_of_image>"]
        config["eoi_token_index"] = ids["<end_of_image>"]
        config["hidden_size"] = config["text_config"]["hidden_size"]
        config["pad_token_id"] = special_token_id("<|endoftext|>")
    return config


def _model_of(config: dict[str, Any]) -> Any:
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    return module.Model(model_config)


def preprocessor_config(family: str, image_size: int = IMAGE_SIZE) -> dict[str, Any]:
    """The ``preprocessor_config.json`` contents of ``family`` at ``image_size``."""
    config = copy.deepcopy(VLM_FAMILIES[family]["preprocessor"])
    if "crop_size" in config:
        config["size"] = {"shortest_edge": image_size}
        config["crop_size"] = {"height": image_size, "width": image_size}
    else:
        config["size"] = {"height": image_size, "width": image_size}
    return config


def build_vlm_weights(family: str, *, seed: int = 0,
                      image_size: int = IMAGE_SIZE) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (weights, config) of a tiny ``family`` VLM, weights named as mlx-vlm loads them."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    config = vlm_family_config(family, image_size)
    family_seed = zlib.crc32(f"vlm-{family}/{seed}".encode())
    mx.random.seed(family_seed)
    model = _model_of(config)
    projections = sorted((name, module) for name, module in model.named_modules()
                         if isinstance(module, (nn.Linear, nn.Embedding)))
    keys = mx.random.split(mx.random.key(family_seed), len(projections))
    params = dict(tree_flatten(model.parameters()))
    for (name, module), subkey in zip(projections, keys):
        shape = params[f"{name}.weight"].shape
        std = EMBEDDING_INIT_STD if isinstance(module, nn.Embedding) else shape[-1] ** -0.5
        params[f"{name}.weight"] = mx.random.normal(shape, scale=std, key=subkey)
    if family == "gemma3":
        # mlx-vlm starts the projection at ones: every image would embed alike.
        shape = params["multi_modal_projector.mm_input_projection_weight"].shape
        params["multi_modal_projector.mm_input_projection_weight"] = mx.random.normal(
            shape, scale=shape[0] ** -0.5, key=mx.random.key(family_seed + 1))
    weights = {name: value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) else value
               for name, value in sorted(params.items())}
    mx.eval(weights)
    return weights, config


def build_vlm_model(family: str, out_dir: Path, *, seed: int = 0, image_size: int = IMAGE_SIZE) -> Path:
    """Build a tiny ``family`` VLM into ``out_dir`` (created) and return ``out_dir``."""
    import mlx.core as mx

    weights, config = build_vlm_weights(family, seed=seed, image_size=image_size)
    spec = VLM_FAMILIES[family]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(family, image_size), indent=2, sort_keys=True) + "\n")
    tokenizer_json, tok_config = _tokenizer_files(spec["image_tokens"], spec["placeholder"])
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


def cached_vlm_model(family: str, seed: int = 0, *, cache_dir: Path | None = None) -> Path:
    """Path of a ``family`` VLM built once per process (under ``cache_dir`` or a
    temporary directory removed at exit)."""
    return cached_build(f"vlm-{family}", lambda directory: build_vlm_model(family, directory, seed=seed),
                        seed, cache_dir)
