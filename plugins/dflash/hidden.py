"""Reading the target's hidden states at chosen layers during one forward.

A DFlash draft is conditioned on the target's hidden states. mlx-lm models return only
logits, so for the length of one forward the chosen layers are wrapped by a recorder
and put back afterwards: the model the fallback engine shares is never left changed
(both run on the one MLX thread, so no other forward can see the wrappers).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx


def decoder_layers(model: Any) -> list[Any]:
    """The list of decoder layers of an mlx-lm model."""
    for owner in (getattr(model, "model", None), getattr(model, "language_model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, list):
            return layers
        inner = getattr(owner, "model", None)
        if inner is not None and isinstance(getattr(inner, "layers", None), list):
            return inner.layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


class _Recorder:
    def __init__(self, layer: Any, slot: int, outputs: list[Any]) -> None:
        self.layer = layer
        self.slot = slot
        self.outputs = outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(*args, **kwargs)
        self.outputs[self.slot] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)


class HiddenCapture:
    """``with HiddenCapture(model, layer_ids): model(...)``; then :meth:`hidden`.

    With ``layer_ids`` ``None`` it records nothing and :meth:`hidden` is ``None``.
    """

    def __init__(self, model: Any, layer_ids: Sequence[int] | None) -> None:
        self.model = model
        self.layer_ids = tuple(layer_ids) if layer_ids is not None else None
        self._outputs: list[Any] = []
        self._originals: list[tuple[int, Any]] = []

    def __enter__(self) -> "HiddenCapture":
        if self.layer_ids is None:
            return self
        layers = decoder_layers(self.model)
        self._outputs = [None] * len(self.layer_ids)
        for slot, index in enumerate(self.layer_ids):
            self._originals.append((index, layers[index]))
            layers[index] = _Recorder(layers[index], slot, self._outputs)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._originals:
            return
        layers = decoder_layers(self.model)
        for index, layer in self._originals:
            layers[index] = layer
        self._originals = []

    def hidden(self) -> mx.array | None:
        """``(1, tokens, len(layer_ids) * hidden)``: the recorded layers' outputs side by side."""
        if self.layer_ids is None or not self._outputs or any(o is None for o in self._outputs):
            return None
        return mx.concatenate(self._outputs, axis=-1)


__all__ = ["HiddenCapture", "decoder_layers"]
