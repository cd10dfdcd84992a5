"""The batched scheduler, extended to prompts that hold images.

Everything text does is the batched engine's :class:`~omlx_core.plugins.batched.scheduler.Scheduler`
unchanged: admission, chunked and gated prefill, mlx-lm's ``BatchGenerator`` for
decode, preemption, the prefix cache. What images change:

- **encoding**: a request's images go through the vision tower once, on the MLX
  thread, right before the first prefill chunk that reaches an image token (so a
  request whose images are all inside a reused prefix never encodes them). mlx-vlm's
  own merge (``get_input_embeddings``, run over the image tokens alone) gives one row
  per image token, in the language model's input space; the rows are dropped once
  prefill has passed the last image.
- **prefill**: a chunk that covers image tokens feeds input embeddings (its tokens'
  own, the image rows written over the image tokens') in place of token ids, and runs
  alone; every other chunk,
  the first-token forward and decode feed tokens, as for text.
- **prefix cache**: blocks are keyed by the prompt with every image token replaced by
  a value derived from the sha256 of that image's bytes
  (:meth:`VLMScheduler.cache_key`): the same image with the same text hits, a
  different image behind the same text never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from omlx_core.memory.gate import PrefillStep
from omlx_core.plugins.batched.scheduler import PREFILLING, Scheduler, SequenceState


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


class VLMScheduler(Scheduler):
    """A :class:`Scheduler` whose requests' prompts may hold images (see the module)."""

    def __init__(self, *, vlm: Any, family: str, image_token_id: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vlm = vlm
        self.family = family
        self.image_token_id = image_token_id
        #: requests whose images went through the vision tower
        self.images_encoded = 0

    def shutdown(self) -> None:
        super().shutdown()
        self.vlm = None

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "images_encoded": self.images_encoded}

    # -- the prefix-cache key --------------------------------------------------------

    def cache_key(self, sequence: SequenceState) -> list[int]:
        return self._keyed(sequence, sequence.context)

    @staticmethod
    def _keyed(sequence: SequenceState, tokens: Sequence[int]) -> list[int]:
        key = getattr(sequence, "key_prompt", None)
        if not key:
            return list(tokens)
        if len(tokens) <= len(key):
            return key[:len(tokens)]
        return key + list(tokens[len(key):])

    def _store_finished_blocks(self, sequence: SequenceState, cache: list[Any], tokens: list[int]) -> None:
        super()._store_finished_blocks(sequence, cache, self._keyed(sequence, tokens))

    # -- prefill with images ---------------------------------------------------------

    @staticmethod
    def _covers_image(sequence: SequenceState, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e in getattr(sequence, "image_spans", ()))

    def _forward_groups(self, plan: list[tuple[SequenceState, int, int]]
                        ) -> list[list[tuple[SequenceState, int, int]]]:
        # A chunk fed as embeddings cannot share the batched forward, which feeds ids.
        alone = [chunk for chunk in plan if self._covers_image(*chunk)]
        if not alone:
            return super()._forward_groups(plan)
        alone_ids = {id(chunk) for chunk in alone}
        groups = super()._forward_groups([chunk for chunk in plan if id(chunk) not in alone_ids])
        groups += [[chunk] for chunk in alone]
        order = {id(chunk): index for index, chunk in enumerate(plan)}
        return sorted(groups, key=lambda group: order[id(group[0])])

    def _prefill_step_of(self, plan: list[tuple[SequenceState, int, int]],
                         groups: list[list[tuple[SequenceState, int, int]]] | None = None
                         ) -> PrefillStep:
        """The base step, with the images each chunk's forward encodes first: the gate
        counts their vision-tower activations and features."""
        step = super()._prefill_step_of(plan, groups)
        ordered = [chunk for group in (groups if groups is not None else [[c] for c in plan])
                   for chunk in group]
        chunks = []
        encoding: set[int] = set()
        for (sequence, start, end), chunk in zip(ordered, step.chunks):
            if (isinstance(sequence, VLMSequence) and sequence.features is None
                    and id(sequence) not in encoding and self._covers_image(sequence, start, end)):
                encoding.add(id(sequence))
                chunk = replace(chunk, images=len(sequence.images))
            chunks.append(chunk)
        return replace(step, chunks=tuple(chunks))

    def _prefill_chunk(self, sequence: SequenceState, start: int, end: int) -> None:
        if not self._covers_image(sequence, start, end):
            super()._prefill_chunk(sequence, start, end)
            return
        assert isinstance(sequence, VLMSequence)
        with mx.stream(generation_stream):
            embeddings = self._embeddings(sequence, start, end)
            self.model(mx.array(sequence.context[start:end])[None], cache=sequence.cache,
                       input_embeddings=embeddings[None])
            mx.eval([layer.state for layer in sequence.cache])
        del embeddings
        if end >= sequence.image_spans[-1][1]:
            sequence.features = None
        self.counters.prefill_forwards += 1
        self._chunk_done(sequence, start, end, self._check_after_forward([(sequence, start, end)]))

    def _embeddings(self, sequence: VLMSequence, start: int, end: int) -> mx.array:
        """Input embeddings of context positions ``[start, end)``: the tokens' own, with
        the image features written over the image tokens'."""
        if sequence.features is None:
            sequence.features = self._encode(sequence)
        embeddings = self.model.model.embed_tokens(mx.array(sequence.context[start:end]))
        local, rows = [], []
        row = 0  # the feature row of the span's first token
        for span_start, span_end in sequence.image_spans:
            first, last = max(span_start, start), min(span_end, end)
            if first < last:
                local.extend(range(first - start, last - start))
                rows.extend(range(row + first - span_start, row + last - span_start))
            row += span_end - span_start
        embeddings[mx.array(local)] = sequence.features[mx.array(rows)].astype(embeddings.dtype)
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

    def _finish(self, sequence: SequenceState, reason: str, **kwargs: Any) -> None:
        if isinstance(sequence, VLMSequence):
            sequence.features = None
        super()._finish(sequence, reason, **kwargs)

    def _requeue(self, sequences: list[SequenceState], *, tell_gate: bool) -> None:
        for sequence in sequences:
            if isinstance(sequence, VLMSequence) and sequence.phase == PREFILLING:
                sequence.features = None
        super()._requeue(sequences, tell_gate=tell_gate)


__all__ = ["VLMScheduler", "VLMSequence", "image_spans", "keyed_prompt"]
