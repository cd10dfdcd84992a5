"""The two backbones the encoder engine runs a padded batch on, behind one interface:
tokenize an input or a query/document pair, and turn a batch into vectors or scores.

- :class:`BertBackbone`: this plugin's BERT-family encoder (:mod:`.bert`) with the
  model's own ``tokenizer.json`` (``tokenizers``); mean, cls or last-token pooling over
  the real tokens; a cross-encoder's classification logit as the score.
- :class:`DecoderBackbone`: a decoder loaded by mlx-lm (through omlx-core's loader),
  run as ``model.model(ids)`` for its final hidden states with no cache. Rows are
  right-padded, so causal attention never lets a real position see padding: a row's
  states are the ones it has alone. Embeddings pool the last real token (the
  tokenizer's end-of-sequence token appended, Qwen3-Embedding style) or the mean;
  queries get ``Instruct: ...\\nQuery:`` before them when the model has an instruction.
  Reranking scores ``P(yes)`` against ``no`` at the last position of a
  Qwen3-Reranker-style prompt, from those two rows of the output projection only.

Everything here runs on the MLX thread except tokenization, which the request threads do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from omlx_core.encoding import EncodeInput
from omlx_core.models.errors import ModelError
from omlx_core.plugins.encoder.layout import EncoderLayout

#: Qwen3-Reranker's prompt around the instruction, query and document
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements "
                 "based on the Query and the Instruct provided. Note that the answer can only "
                 "be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class PaddedBatch:
    """Rows right-padded to one width: ``ids`` and ``type_ids`` ``(rows, width)``."""

    ids: np.ndarray
    type_ids: np.ndarray | None
    lengths: np.ndarray

    @classmethod
    def of(cls, inputs: Sequence[EncodeInput], pad_id: int) -> "PaddedBatch":
        width = max(len(item) for item in inputs)
        ids = np.full((len(inputs), width), pad_id, dtype=np.int32)
        types = None
        for row, item in enumerate(inputs):
            ids[row, :len(item)] = item.token_ids
            if item.token_type_ids is not None:
                if types is None:
                    types = np.zeros((len(inputs), width), dtype=np.int32)
                types[row, :len(item)] = item.token_type_ids
        lengths = np.array([len(item) for item in inputs], dtype=np.int32)
        return cls(ids, types, lengths)


def pool(states: Any, lengths: Any, pooling: str) -> Any:
    """One vector per row of ``states`` ``(rows, width, hidden)`` from its real tokens."""
    import mlx.core as mx

    if pooling == "cls":
        return states[:, 0]
    if pooling == "last":
        return states[mx.arange(states.shape[0]), lengths - 1]
    real = (mx.arange(states.shape[1])[None, :] < lengths[:, None]).astype(states.dtype)
    return (states * real[..., None]).sum(axis=1) / lengths[:, None].astype(states.dtype)


def normalized(vectors: Any) -> Any:
    import mlx.core as mx

    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, 1e-12)


def _cut(ids: list[int], room: int, what: str) -> list[int]:
    if room < 1:
        raise ValueError(f"truncating to so few tokens leaves no room for the {what}")
    return ids[:room]


class BertBackbone:
    """A BERT-family encoder and its ``tokenizer.json``."""

    def __init__(self, path: Path, layout: EncoderLayout, model_config: dict[str, Any]):
        import mlx.core as mx
        from tokenizers import Tokenizer

        from omlx_core.plugins.encoder.bert import BertConfig, BertModel, checkpoint_weights

        self.layout = layout
        config = BertConfig.from_dict(model_config, classifier=layout.classifier)
        if layout.classifier and config.num_labels != 1:
            raise ModelError(f"a cross-encoder must have one label to score with; this one has "
                             f"{config.num_labels}")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(f"{path} has no tokenizer.json (the encoder engine reads the fast "
                             "tokenizer's file)")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        weights: dict[str, Any] = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(mx.load(str(file)))
        self.model = BertModel(config)
        try:
            self.model.load_weights(list(checkpoint_weights(weights, config).items()), strict=True)
        except ValueError as exc:
            raise ModelError(f"the weights in {path} do not fit a {config.model_type} encoder "
                             f"of its config.json: {exc}") from None
        self.model.eval()
        mx.eval(self.model.parameters())
        self.dtype_bytes = next(iter(weights.values())).dtype.size if weights else 4
        if mx.default_device().type == mx.cpu:
            from omlx_core.models import cpu_kernels

            cpu_kernels.kernels()  # built (once) or loaded now, at load: never in a forward
        self.vocab_size = config.vocab_size
        self.dimensions = config.hidden_size
        self.max_length = min(layout.max_length or config.max_length, config.max_length)
        self.pad_id = config.pad_token_id
        self._specials_single = self.tokenizer.num_special_tokens_to_add(False)
        self._specials_pair = self.tokenizer.num_special_tokens_to_add(True)

    def tokenize_input(self, text: str, role: str, truncate_to: int | None) -> EncodeInput:
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        if truncate_to is not None:
            encoding.truncate(len(_cut(encoding.ids, truncate_to - self._specials_single,
                                       "text")))
        full = self.tokenizer.post_process(encoding, None, True)
        return EncodeInput(tuple(full.ids))

    def tokenize_pair(self, query: str, document: str, truncate_to: int | None) -> EncodeInput:
        first = self.tokenizer.encode(query, add_special_tokens=False)
        second = self.tokenizer.encode(document, add_special_tokens=False)
        if truncate_to is not None:
            # The document gives way first, down to one token, then the query.
            over = len(first.ids) + len(second.ids) - (truncate_to - self._specials_pair)
            if over > 0:
                from_document = min(over, len(second.ids) - 1)
                second.truncate(len(second.ids) - from_document)
                over -= from_document
            if over > 0:
                first.truncate(len(_cut(first.ids, len(first.ids) - over, "query")))
        full = self.tokenizer.post_process(first, second, True)
        return EncodeInput(tuple(full.ids), tuple(full.type_ids))

    def run(self, batch: PaddedBatch, kind: str) -> np.ndarray:
        import mlx.core as mx

        real = np.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
        states = self.model.packed(batch.ids[real], batch.lengths,
                                   None if batch.type_ids is None else batch.type_ids[real])
        if states is not None:
            return self._packed_out(states, batch.lengths, kind)
        lengths = mx.array(batch.lengths)
        types = mx.array(batch.type_ids) if batch.type_ids is not None else None
        states = self.model(mx.array(batch.ids), lengths, types)
        if kind == "score":
            out = self._scores(states[:, 0])
        else:
            out = pool(states, lengths, self.layout.pooling)
            if self.layout.normalize:
                out = normalized(out)
        out = out.astype(mx.float32)
        mx.eval(out)
        return np.array(out)

    def _scores(self, first: Any) -> Any:
        import mlx.core as mx

        logits = self.model.classify(first)[:, 0]
        return mx.sigmoid(logits) if self.layout.sigmoid else logits

    def _packed_out(self, states: Any, lengths: np.ndarray, kind: str) -> np.ndarray:
        """Vectors or scores from packed token states ``(tokens, hidden)``, row ``i`` the
        next ``lengths[i]`` tokens."""
        import mlx.core as mx

        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        if kind == "score":
            out = self._scores(states[mx.array(starts)]).astype(mx.float32)
            mx.eval(out)
            return np.array(out)
        mx.eval(states)
        tokens = np.array(states.astype(mx.float32), copy=False)
        if self.layout.pooling == "cls":
            vectors = tokens[starts]
        elif self.layout.pooling == "last":
            vectors = tokens[starts + lengths - 1]
        else:
            vectors = np.add.reduceat(tokens, starts, axis=0) / lengths[:, None].astype(np.float32)
        if self.layout.normalize:
            norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32)


class DecoderBackbone:
    """A decoder mlx-lm loads, embedding or reranking (see the module docstring)."""

    def __init__(self, path: Path, layout: EncoderLayout, model_config: dict[str, Any]):
        import mlx.core as mx

        from omlx_core.models.loader import activation_dtype_bytes, load_model

        self.layout = layout
        self.model, wrapper = load_model(path)
        self.tokenizer = wrapper
        self.dtype_bytes = activation_dtype_bytes(self.model)
        args = getattr(self.model, "args", None)
        self.vocab_size = int(getattr(args, "vocab_size", 0) or model_config.get("vocab_size", 0))
        self.dimensions = int(getattr(args, "hidden_size", 0) or model_config.get("hidden_size", 0))
        own = int(model_config.get("max_position_embeddings") or 0) or None
        self.max_length = min(x for x in (layout.max_length, own, 8192) if x)
        eos = wrapper.eos_token_ids
        self.eos_id = min(eos) if eos else None
        self.pad_id = self.eos_id if self.eos_id is not None else 0
        self._yes_no: tuple[int, int] | None = None
        if layout.task == "rerank":
            self._yes_no = (self._single_token("yes"), self._single_token("no"))
            self._rows = self._output_rows(mx.array(self._yes_no))
            mx.eval(self._rows)
            self._prefix = self._encode(RERANK_PREFIX)
            self._suffix = self._encode(RERANK_SUFFIX)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _single_token(self, word: str) -> int:
        ids = self._encode(word)
        if len(ids) != 1:
            raise ModelError(f"a decoder reranker answers {word!r} in one token; this "
                             f"tokenizer splits it into {len(ids)}")
        return ids[0]

    def tokenize_input(self, text: str, role: str, truncate_to: int | None) -> EncodeInput:
        prefix: list[int] = []
        if role == "query" and self.layout.instruction:
            prefix = self._encode(f"Instruct: {self.layout.instruction}\nQuery:")
        body = self._encode(text)
        suffix = [self.eos_id] if self.layout.pooling == "last" and self.eos_id is not None else []
        if truncate_to is not None:
            body = _cut(body, truncate_to - len(prefix) - len(suffix), "text")
        return EncodeInput(tuple(prefix + body + suffix))

    def tokenize_pair(self, query: str, document: str, truncate_to: int | None) -> EncodeInput:
        if self._yes_no is None:
            raise ValueError("this model embeds; it scores pairs by cosine, not in one sequence")
        head = self._prefix + self._encode(f"<Instruct>: {self.layout.instruction}\n"
                                           f"<Query>: {query}\n<Document>: ")
        body = self._encode(document)
        if truncate_to is not None:
            body = _cut(body, truncate_to - len(head) - len(self._suffix), "document")
        return EncodeInput(tuple(head + body + self._suffix))

    def run(self, batch: PaddedBatch, kind: str) -> np.ndarray:
        import mlx.core as mx

        lengths = mx.array(batch.lengths)
        states = self.model.model(mx.array(batch.ids))
        if kind == "score":
            last = pool(states, lengths, "last")
            logits = last @ self._rows.T.astype(last.dtype)
            out = mx.sigmoid(logits[:, 0] - logits[:, 1])
        else:
            out = pool(states, lengths, self.layout.pooling)
            if self.layout.normalize:
                out = normalized(out)
        out = out.astype(mx.float32)
        mx.eval(out)
        return np.array(out)

    def _output_rows(self, token_ids: Any) -> Any:
        """The output projection's rows of ``token_ids``: the model's lm_head, or the input
        embedding it ties to, dequantized where the model is quantized."""
        import mlx.core as mx

        head = getattr(self.model, "lm_head", None)
        if head is None:
            return self.model.model.embed_tokens(token_ids)
        if hasattr(head, "rows"):  # held packed (omlx_core.models.packed_linear)
            return head.rows(token_ids)
        if hasattr(head, "scales"):
            biases = head.get("biases") if isinstance(head, dict) else getattr(head, "biases", None)
            return mx.dequantize(head.weight[token_ids], head.scales[token_ids],
                                 None if biases is None else biases[token_ids],
                                 group_size=head.group_size, bits=head.bits)
        return head.weight[token_ids]


__all__ = ["BertBackbone", "DecoderBackbone", "PaddedBatch", "RERANK_PREFIX", "RERANK_SUFFIX",
           "normalized", "pool"]
