"""The ``vlm`` engine: the batched engine serving an mlx-vlm model, images and text."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from omlx_core.engine import GenerationRequest, ImagePart
from omlx_core.scheduling import BatchedEngine
from omlx_core.scheduling import new_sequence
from omlx_core.plugins.vlm.bound import ImageTokenBound, image_token_bound, read_processor_config
from omlx_core.plugins.vlm.images import ImageLimits, PreparedImage, check_parts, prepare
from omlx_core.plugins.vlm.model import (
    ImageLayout,
    family_of,
    image_layout,
    load_vlm,
    processor_chat_template,
)
from omlx_core.plugins.vlm.scheduler import VLMScheduler, VLMSequence, image_spans, keyed_prompt

if TYPE_CHECKING:
    from omlx_core.host import EngineHost
    from omlx_core.scheduling import ModelSpec


@dataclass(frozen=True)
class VLMSettings:
    """The ``[plugin.vlm]`` keys the engine reads."""

    limits: ImageLimits

    @classmethod
    def from_config(cls, config: Any) -> "VLMSettings":
        dirs = config["plugin.vlm.allowed_image_dirs"] or []
        return cls(ImageLimits(
            max_images=int(config["plugin.vlm.max_images"]),
            max_image_pixels=int(config["plugin.vlm.max_image_pixels"]),
            max_image_bytes=int(config["plugin.vlm.max_image_bytes"]),
            allowed_dirs=tuple(Path(d).expanduser().resolve() for d in dirs)))


class VLMEngine(BatchedEngine):
    """Serves an mlx-vlm model (image + text chat) with the batched engine's continuous
    batching, chunked gated prefill and prefix cache; its memory receiver is its
    :class:`~.scheduler.VLMScheduler`."""

    accepts_images = True

    def __init__(self, model: ModelSpec, host: EngineHost, **kwargs: Any) -> None:
        super().__init__(model, host, **kwargs)
        self.family = family_of(model.config)
        self.vlm_settings = VLMSettings.from_config(host.config)
        self.layout: ImageLayout | None = None
        self.bound: ImageTokenBound | None = None
        self.image_processor: Any = None
        self._processor_lock = threading.Lock()

    # -- loading ---------------------------------------------------------------------

    def _load(self) -> VLMScheduler:
        from mlx_lm.utils import load_tokenizer
        from transformers import AutoImageProcessor

        from omlx_core.scheduling import hf_tokenizer

        vlm, lm, config = load_vlm(self.model.path)
        # The estimate reads the model's config: give it the dims the model was built with.
        self.model = dataclasses.replace(self.model, config=config)
        tokenizer = load_tokenizer(Path(self.model.path), eos_token_ids=config.get("eos_token_id"))
        hf = hf_tokenizer(tokenizer)
        if getattr(hf, "chat_template", None) is None:
            template = processor_chat_template(self.model.path)
            if template is not None:
                hf.chat_template = template
                tokenizer.has_chat_template = True
        # The PIL backend: transformers' torchvision one needs torch, which is not installed.
        self.image_processor = AutoImageProcessor.from_pretrained(str(self.model.path), backend="pil")
        self.layout = image_layout(config, tokenizer)
        self.bound = image_token_bound(read_processor_config(self.model.path), config)
        if self.layout.tokens_per_image > self.bound.tokens:
            raise RuntimeError(
                f"model {self.model.id!r}: an image takes {self.layout.tokens_per_image} tokens, over "
                f"the preflight bound of {self.bound.tokens} ({self.bound.source}); preflight would "
                "undercount its prompts")
        self.adopt(lm, tokenizer)
        return VLMScheduler(
            vlm=vlm, family=self.family, image_token_id=self.layout.image_token_id,
            model=lm, tokenizer=tokenizer, model_id=self.model.id, model_config=self.model.config,
            vocab_size=self.vocab_size, max_batch_size=self.settings.max_batch_size,
            prefill_step_size=self.settings.prefill_step_size, prefix_cache=self.prefix_cache,
            batch_window_s=self.settings.batch_window_s,
            wake=self._thread.wake, boundary_listener=self.host.on_boundary_snapshot,
            finish_listener=self.host.on_request_finished, kv_format=self.kv_format,
        )

    # -- images ----------------------------------------------------------------------

    def check_images(self, images: Sequence[ImagePart]) -> None:
        check_parts(images, self.vlm_settings.limits)

    def prepare_images(self, images: Sequence[ImagePart]) -> list[PreparedImage]:
        self._require_started()
        check_parts(images, self.vlm_settings.limits)
        with self._processor_lock:
            return prepare(images, self.vlm_settings.limits, self.image_processor)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], images: Sequence[PreparedImage] | None = None,
                      **template_kwargs: Any) -> list[int]:
        """The prompt's tokens, every image expanded to its tokens. Without ``images``
        (not decoded yet) each counts at the preflight bound; this engine's families
        take a fixed count per image, so both are the same tokens."""
        self._require_started()
        layout = self.layout
        assert layout is not None
        parts = [{**m, "content": [_template_part(p) for p in m["content"]]}
                 if isinstance(m.get("content"), (list, tuple)) else dict(m) for m in messages]
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(parts, add_generation_prompt=True,
                                                      tokenize=False, **template_kwargs)
            wanted = sum(1 for m in parts if isinstance(m.get("content"), list)
                         for p in m["content"] if p.get("type") == "image")
            written = text.count(layout.placeholder)
            if written > wanted:
                raise ValueError(f"the messages' text holds this model's image placeholder "
                                 f"{layout.placeholder!r} ({written - wanted} more than the images "
                                 "sent); remove it from the text and send images as image parts")
            if written < wanted:
                raise ValueError(f"the model's chat template placed {written} of {wanted} images "
                                 "(it renders images only in some messages); send the images in "
                                 "user messages")
            text = text.replace(layout.placeholder, layout.expand())
            tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        if wanted and tokens and tokens[-1] == layout.image_token_id:
            raise ValueError("the prompt ends with an image; add text after it")
        return tokens

    def _new_sequence(self, request: GenerationRequest) -> VLMSequence:
        base = new_sequence(request)
        images = tuple(request.images or ())
        layout = self.layout
        assert layout is not None
        spans = image_spans(base.prompt, layout.image_token_id, layout.tokens_per_image)
        if len(spans) != len(images) or any(e - s != layout.tokens_per_image for s, e in spans):
            raise ValueError(f"the prompt holds {len(spans)} images' tokens for {len(images)} "
                             f"images of {layout.tokens_per_image} tokens each; tokenize it with "
                             "this engine's tokenize_chat and the same images")
        key = keyed_prompt(base.prompt, spans, [image.digest for image in images], self.vocab_size) \
            if images else []
        return VLMSequence(request=base.request, outputs=base.outputs, prompt=base.prompt,
                           seed=base.seed, context=base.context, images=images,
                           image_spans=tuple(spans), key_prompt=key)

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        if self.bound is not None:
            stats["image_token_bound"] = self.bound.tokens
        return stats


def _template_part(part: Mapping[str, Any]) -> dict[str, Any]:
    # The template sees the part's type only: the image itself is not text.
    return {"type": "image"} if part.get("type") == "image" else dict(part)
