"""The batched scheduler, extended to prompts that hold images.

Everything text does is the batched engine's :class:`~omlx_core.scheduling.scheduler.Scheduler`
unchanged: admission, chunked and gated prefill, mlx-lm's ``BatchGenerator`` for
decode, preemption, the prefix cache. What images change, it changes through the
scheduler's declared extension points (:mod:`omlx_core.scheduling.extensions`):
:class:`ImageInputs` is its ``inputs`` and :func:`image_key` its ``cache_key``.

- **encoding**: a request's images go through the vision tower once, on the MLX
  thread, right before the first prefill chunk that reaches an image token (so a
  request whose images are all inside a reused prefix never encodes them). mlx-vlm's
  own merge (``get_input_embeddings``, run over the image tokens alone) gives one row
  per image token, in the language model's input space; the rows are dropped once
  prefill has passed the last image.
- **prefill**: a chunk that covers image tokens feeds input embeddings (its tokens'
  own, the image rows written over the image tokens') in place of token ids, and runs
  alone; every other chunk, the first-token forward and decode feed tokens, as for
  text. The forward gate is told which chunk's forward encodes the images.
- **prefix cache**: blocks are keyed by the prompt with every image token replaced by
  a value derived from the sha256 of that image's bytes
  (:func:`image_key`): the same image with the same text hits, a
  different image behind the same text never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import mlx.core as mx

from omlx_core.scheduling import Scheduler, SequenceState, salted_keys


@dataclass(eq=False)
class VLMSequence(SequenceState):
    """A request whose prompt may hold images."""

    #: the request's prepared images (``plugins.vlm.images.PreparedImage``), in order
    images: tuple[Any, ...] = ()
    #: ``[start, end)`` prompt positions of each image's tokens
    image_spans: tuple[tuple[int, int], ...] = ()
    #: the prompt as the prefix cache keys it (image tokens replaced by image keys)
    key_prompt: list[int] = field(default_factory=list)
    #: the images' features, one row per image token (while prefill needs them)
    features: Any = None


def image_spans(prompt: Sequence[int], image_token_id: int, tokens_per_image: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every image's tokens in ``prompt``: runs of ``image_token_id``,
    a run of adjacent images cut every ``tokens_per_image``; a run of any other length
    is left whole (and then matches no image)."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, token in enumerate(prompt):
        if token == image_token_id:
            if start is None:
                start = position
        elif start is not None:
            runs.append((start, position))
            start = None
    if start is not None:
        runs.append((start, len(prompt)))
    spans: list[tuple[int, int]] = []
    for start, end in runs:
        if (end - start) % tokens_per_image:
            spans.append((start, end))
        else:
            spans.extend((s, s + tokens_per_image) for s in range(start, end, tokens_per_image))
    return spans


def keyed_prompt(prompt: Sequence[int], spans: Sequence[tuple[int, int]],
                 digests: Sequence[bytes], vocab_size: int) -> list[int]:
    """``prompt`` with the tokens of image ``i`` replaced by a key of ``digests[i]``:
    outside the vocabulary, so no text token ever equals it."""
    keyed = list(prompt)
    for (start, end), digest in zip(spans, digests):
        key = vocab_size + int.from_bytes(digest[:7], "big")
        keyed[start:end] = [key] * (end - start)
    return keyed


def image_key(sequence: SequenceState, tokens: Sequence[int]) -> Sequence[int]:
    """The prefix cache's key of ``tokens`` (a prefix of ``sequence``'s prompt and
    completion): its image tokens replaced by their images' keys (:func:`keyed_prompt`)."""
    key = sequence.key_prompt if isinstance(sequence, VLMSequence) else None
    if not key:
        keyed = tokens
    elif len(tokens) <= len(key):
        keyed = key[:len(tokens)]
    else:
        keyed = key + list(tokens[len(key):])
    return salted_keys(keyed, sequence.request.cache_salt)


def _covers_image(sequence: SequenceState, start: int, end: int) -> bool:
    return isinstance(sequence, VLMSequence) and any(s < end and start < e for s, e in sequence.image_spans)


class ImageInputs:
    """The scheduler's :class:`~omlx_core.scheduling.extensions.ChunkInputs` for
    prompts with images: a chunk that covers image tokens feeds input embeddings."""

    def __init__(self, *, vlm: Any, language_model: Any, family: str, image_token_id: int) -> None:
        self.vlm = vlm
        self.language_model = language_model
        self.family = family
        self.image_token_id = image_token_id
        #: images that went through the vision tower
        self.images_encoded = 0

    def embeds(self, sequence: SequenceState, start: int, end: int) -> bool:
        return _covers_image(sequence, start, end)

    def encodes(self, sequence: SequenceState, start: int, end: int) -> int:
        if not isinstance(sequence, VLMSequence) or sequence.features is not None:
            return 0
        return len(sequence.images) if _covers_image(sequence, start, end) else 0

    def embeddings(self, sequence: SequenceState, start: int, end: int) -> mx.array:
        """Input embeddings of context positions ``[start, end)``: the tokens' own, with
        the image features written over the image tokens'. The features are dropped once
        prefill has passed the last image."""
        assert isinstance(sequence, VLMSequence)
        if sequence.features is None:
            sequence.features = self._encode(sequence)
        embeddings = self.language_model.model.embed_tokens(mx.array(sequence.context[start:end]))
        local, rows = [], []
        row = 0  # the feature row of the span's first token
        for span_start, span_end in sequence.image_spans:
            first, last = max(span_start, start), min(span_end, end)
            if first < last:
                local.extend(range(first - start, last - start))
                rows.extend(range(row + first - span_start, row + last - span_start))
            row += span_end - span_start
        embeddings[mx.array(local)] = sequence.features[mx.array(rows)].astype(embeddings.dtype)
        if end >= sequence.image_spans[-1][1]:
            sequence.features = None
        return embeddings

    def _encode(self, sequence: VLMSequence) -> mx.array:
        """The images' features as the language model takes them, one row per image
        token: the vision tower and projector, then mlx-vlm's merge for the family run
        over the image tokens alone (which writes each family's scaling in)."""
        import numpy as np

        count = sum(end - start for start, end in sequence.image_spans)
        ids = mx.array([[self.image_token_id] * count])
        pixels = mx.array(np.stack([image.pixel_values for image in sequence.images]))
        kwargs: dict[str, Any] = {}
        if self.family == "gemma3":
            # Its merge also builds a (never evaluated, so never allocated) 4-D mask.
            kwargs["mask"] = mx.ones(ids.shape)
        features = self.vlm.get_input_embeddings(ids, pixels, **kwargs).inputs_embeds[0]
        mx.eval(features)
        self.images_encoded += len(sequence.images)
        return features

    def release(self, sequence: SequenceState) -> None:
        if isinstance(sequence, VLMSequence):
            sequence.features = None

    def stats(self) -> Mapping[str, Any]:
        return {"images_encoded": self.images_encoded}

    def close(self) -> None:
        self.vlm = self.language_model = None


class VLMScheduler(Scheduler):
    """A :class:`Scheduler` whose requests' prompts may hold images (see the module):
    its ``inputs`` are :class:`ImageInputs`, its ``cache_key`` :func:`image_key`."""

    def __init__(self, *, vlm: Any, family: str, image_token_id: int, **kwargs: Any) -> None:
        self.images = ImageInputs(vlm=vlm, language_model=kwargs["model"], family=family,
                                  image_token_id=image_token_id)
        super().__init__(inputs=self.images, cache_key=image_key, **kwargs)

    @property
    def vlm(self) -> Any:
        """The mlx-vlm model (``None`` once shut down)."""
        return self.images.vlm


__all__ = ["ImageInputs", "VLMScheduler", "VLMSequence", "image_key", "image_spans", "keyed_prompt"]
