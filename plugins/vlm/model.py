"""Loads an mlx-vlm model directory: the vision side from mlx-vlm, the language model
as the mlx-lm model of its text config, sharing the same weight arrays.

The batched engine's machinery (mlx-lm's ``BatchGenerator``, batched prefill, the
prefix cache's cache layouts) is built on mlx-lm models; serving the VLM's language
model as one lets every text step reuse it unchanged. mlx-lm models take
``input_embeddings`` in place of tokens, which is how a prompt with images is
prefilled. Only families whose language model mlx-lm has, with positions that are
plain token offsets (1-D RoPE), are served: an image's tokens then sit in the KV
cache exactly like text tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_core.scheduling import ModelError

#: VLM ``model_type`` -> what the engine knows of the family
SUPPORTED_FAMILIES = ("llava", "gemma3")


@dataclass(frozen=True)
class ImageLayout:
    """How a family writes images into a prompt.

    ``placeholder``: the text the chat template writes for one image;
    ``expansion``: the text the placeholder becomes, ``{tokens}`` standing for the
    image's tokens (``image_token`` repeated); ``image_token_id``: the id each image
    feature replaces.
    """

    placeholder: str
    expansion: str
    image_token: str
    image_token_id: int
    tokens_per_image: int

    def expand(self) -> str:
        return self.expansion.replace("{tokens}", self.image_token * self.tokens_per_image)


def processor_chat_template(path: Path) -> str | None:
    """The chat template a VLM directory keeps beside its processor
    (``chat_template.jinja`` or ``chat_template.json``) rather than in its tokenizer's
    config, as many LLaVA conversions do; ``None`` when it has neither."""
    jinja = Path(path) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        template = json.loads((Path(path) / "chat_template.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = template.get("chat_template") if isinstance(template, dict) else None
    return value if isinstance(value, str) else None


def read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {Path(path) / 'config.json'}: {exc}") from exc


def family_of(config: dict[str, Any]) -> str:
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED_FAMILIES:
        raise ModelError(
            f"the vlm engine serves model types {', '.join(SUPPORTED_FAMILIES)}; this model is "
            f"{model_type or 'of no model_type'!r}. Serve it with an engine that supports it, "
            "or a text-only model with engine = \"batched\"")
    return model_type


def image_layout(config: dict[str, Any], tokenizer: Any) -> ImageLayout:
    """The family's :class:`ImageLayout` from its config and tokenizer."""
    family = family_of(config)
    vision = config.get("vision_config") or {}
    if family == "llava":
        side = int(vision.get("image_size", 336)) // int(vision.get("patch_size", 14))
        tokens = side * side
        if config.get("vision_feature_select_strategy", "default") == "full":
            tokens += 1  # the CLS token is kept
        token_id = int(config.get("image_token_index", 32000))
        token = tokenizer.convert_ids_to_tokens(token_id)
        return ImageLayout(token, "{tokens}", token, token_id, tokens)
    text = config.get("text_config") or {}
    tokens = int(config.get("mm_tokens_per_image") or text.get("mm_tokens_per_image") or 256)
    token_id = int(config.get("image_token_index", 262144))
    token = tokenizer.convert_ids_to_tokens(token_id)
    boi = tokenizer.convert_ids_to_tokens(int(config.get("boi_token_index", 255999)))
    eoi = tokenizer.convert_ids_to_tokens(int(config.get("eoi_token_index", 256000)))
    return ImageLayout(boi, "\n\n" + boi + "{tokens}" + eoi + "\n\n", token, token_id, tokens)


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The mlx-lm config of the language model inside a VLM config."""
    text = dict(config.get("text_config") or {})
    family = family_of(config)
    if family == "gemma3":
        text["model_type"] = "gemma3_text"
        # mlx-vlm's gemma3 reads the global RoPE base from rope_global_base_freq (its
        # default 1e6), mlx-lm's from rope_theta: give mlx-lm the one mlx-vlm uses.
        text["rope_theta"] = float(text.get("rope_global_base_freq", 1_000_000.0))
        text.setdefault("vocab_size", 262208)
    else:
        text.setdefault("model_type", "llama")
    for key in ("quantization", "quantization_config"):
        if key in config and key not in text:
            text[key] = config[key]
    return text


#: how to install what the engine needs (mlx-vlm without its heavy optional dependencies)
INSTALL_HINT = ("install them with: pip install 'omlx-core[vlm]' && pip install --no-deps "
                "mlx-vlm==0.7.10 (setup.sh does both)")


def require_vlm_dependencies() -> None:
    """Raise :class:`ModelError` naming what is missing and how to install it."""
    import importlib.util

    missing = [name for name, module in (("mlx-vlm", "mlx_vlm"), ("transformers", "transformers"),
                                         ("Pillow", "PIL"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ModelError(f"the vlm engine needs {', '.join(missing)}, which are not installed; "
                         + INSTALL_HINT)


def completed_config(vlm: Any, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``text_config`` and ``vision_config`` completed from the
    defaults mlx-vlm built the model with: HF conversions often keep only what differs
    from a base config (a LLaVA ``text_config`` may be little more than its
    ``model_type``), which neither mlx-lm nor the memory estimate could build from."""
    import dataclasses

    completed = dict(config)
    for key in ("text_config", "vision_config"):
        built = getattr(vlm.config, key, None)
        if dataclasses.is_dataclass(built):
            defaults = {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}
            completed[key] = {**defaults, **(config.get(key) or {})}
    return completed


def load_vlm(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """``(vlm, language_model, config)``: mlx-vlm's model, the mlx-lm model of its text
    side holding the same weights, and the config completed with mlx-vlm's defaults."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from omlx_core.scheduling import install_cpu_routes, model_classes, settle_random_state

    require_vlm_dependencies()
    from mlx_vlm.utils import load_model as load_vlm_model

    path = Path(path)
    config = read_config(path)
    family_of(config)
    try:
        vlm = load_vlm_model(path)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load VLM from {path}: {type(exc).__name__}: {exc}") from exc
    config = completed_config(vlm, config)
    text_config = text_model_config(config)
    model_class, args_class = model_classes(text_config)
    language_model = model_class(args_class.from_dict(text_config))
    weights = dict(tree_flatten(vlm.language_model.parameters()))
    if hasattr(language_model, "sanitize"):
        weights = language_model.sanitize(weights)
    if any(name.endswith(".scales") for name in weights):
        quant = text_config.get("quantization") or text_config.get("quantization_config") or {}
        nn.quantize(language_model, group_size=int(quant.get("group_size", 64)),
                    bits=int(quant.get("bits", 4)),
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    language_model.load_weights(list(weights.items()), strict=True)
    language_model.eval()
    # The routes every text model takes at load, so the text side runs the same path
    # whatever else this process has loaded (a route is a module global of the family).
    install_cpu_routes(language_model)
    settle_random_state()
    return vlm, language_model, config
