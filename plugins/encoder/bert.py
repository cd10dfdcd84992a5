"""BERT-family encoders on ``mlx.nn``: BERT and MiniLM (``model_type`` ``bert``), RoBERTa
and XLM-RoBERTa (positions counted from ``pad_token_id + 1``), each as a plain encoder
or with the sequence-classification head a cross-encoder reranker carries.

Module names follow the Hugging Face checkpoints, so their safetensors load as they are
(:func:`checkpoint_weights` only drops the ``bert.``/``roberta.`` prefix and renames
``attention.self`` to ``attention.self_attn``); once loaded, each layer's query, key and
value projections are fused into one (``qkv``: one matmul of three times the width
instead of three). Rows are right-padded, so a row's real positions keep the position
ids they have alone, and the attention hides each row's padding keys. On the CPU
backend the GELU, the layer norms and the attention run on the vector units
(:mod:`.cpu_routes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx_core.models.errors import ModelError
from omlx_core.plugins.encoder import cpu_routes
from omlx_core.plugins.encoder.cpu_routes import PackedRows, PaddedRows

#: how a forward's rows lie along its token axis
Rows = Union[PaddedRows, PackedRows]
#: model_types this module builds
BERT_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})
#: those whose position ids start after the padding index (fairseq's convention)
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert"})
_ACTIVATIONS = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx,
                "gelu_fast": nn.gelu_fast_approx, "relu": nn.relu, "silu": nn.silu,
                "swish": nn.silu}


@dataclass(frozen=True)
class BertConfig:
    """The dims of a BERT-family ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    #: labels of a sequence-classification head (0: a plain encoder)
    num_labels: int = 0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, classifier: bool = False) -> "BertConfig":
        model_type = str(config.get("model_type", ""))
        if model_type not in BERT_MODEL_TYPES:
            raise ModelError(f"model_type {model_type!r} is not a BERT-family encoder "
                             f"({', '.join(sorted(BERT_MODEL_TYPES))})")
        act = str(config.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ModelError(f"hidden_act {act!r} is not supported by the encoder engine "
                             f"({', '.join(sorted(_ACTIVATIONS))})")
        try:
            dims = {key: int(config[key]) for key in (
                "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "max_position_embeddings")}
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"config.json of a {model_type} model lacks a usable {exc}") from None
        if dims["hidden_size"] % dims["num_attention_heads"]:
            raise ModelError("hidden_size must be a multiple of num_attention_heads")
        labels = 0
        if classifier:
            labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
        return cls(model_type=model_type, type_vocab_size=int(config.get("type_vocab_size", 2)),
                   layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), hidden_act=act,
                   pad_token_id=int(config.get("pad_token_id") or 0), num_labels=labels, **dims)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int:
        return self.pad_token_id + 1 if self.model_type in _OFFSET_POSITIONS else 0

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position_embeddings - self.position_offset


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.offset = config.position_offset

    def __call__(self, ids: mx.array, type_ids: mx.array,
                 positions: mx.array | None = None) -> mx.array:
        if positions is None:
            positions = mx.arange(ids.shape[1])[None]
        words = self.word_embeddings(ids) + self.position_embeddings(positions + self.offset)
        return cpu_routes.layer_norm(self.LayerNorm, words, self.token_type_embeddings(type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.scale = 1.0 / math.sqrt(config.head_dim)
        # The checkpoint's names; :meth:`fuse` makes them one ``qkv`` projection.
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def fuse(self) -> None:
        """Replace the query, key and value projections by one ``qkv`` projection
        whose output holds the three side by side."""
        if "qkv" in self:
            return
        parts = (self.query, self.key, self.value)
        fused = nn.Linear(self.query.weight.shape[1], 3 * self.query.weight.shape[0])
        fused.weight = mx.concatenate([part.weight for part in parts], axis=0)
        fused.bias = mx.concatenate([part.bias for part in parts], axis=0)
        mx.eval(fused.parameters())
        del self.query, self.key, self.value
        self.qkv = fused

    def __call__(self, x: mx.array, rows: Rows) -> mx.array:
        if "qkv" in self:
            qkv = self.qkv(x)
        else:
            qkv = mx.concatenate([self.query(x), self.key(x), self.value(x)], axis=-1)
        return rows.attend(qkv, self.heads, self.scale)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig, inner: int):
        super().__init__()
        self.dense = nn.Linear(inner, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return cpu_routes.layer_norm(self.LayerNorm, self.dense(x), residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self_attn = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)

    def __call__(self, x: mx.array, rows: Rows) -> mx.array:
        return self.output(self.self_attn(x, rows), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        if self.act is nn.gelu:
            return cpu_routes.gelu(self.dense(x))
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)

    def __call__(self, x: mx.array, rows: Rows) -> mx.array:
        x = self.attention(x, rows)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = [BertLayer(config) for _ in range(config.num_hidden_layers)]


class BertPooler(nn.Module):
    """BERT's classification pooler: a dense layer and tanh over the first token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def __call__(self, first: mx.array) -> mx.array:
        return mx.tanh(self.dense(first))


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))


class BertModel(nn.Module):
    """The encoder: token states of a padded batch; with ``num_labels``, also the
    sequence-classification logits of each row's first token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        if config.num_labels and config.model_type in _OFFSET_POSITIONS:
            self.classifier = RobertaClassificationHead(config)
        elif config.num_labels:
            self.pooler = BertPooler(config)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def __call__(self, ids: mx.array, lengths: mx.array,
                 type_ids: mx.array | None = None) -> mx.array:
        """Token states ``(batch, length, hidden)`` of ``ids`` (right-padded; row ``i``
        holds ``lengths[i]`` real tokens)."""
        if type_ids is None:
            type_ids = mx.zeros_like(ids)
        x = self.embeddings(ids, type_ids)
        return self._layers(x, PaddedRows(lengths, ids.shape[1], x.dtype))

    def packed(self, ids: np.ndarray, lengths: np.ndarray,
               type_ids: np.ndarray | None = None) -> mx.array | None:
        """Token states ``(tokens, hidden)`` of rows packed one after another (``ids``
        ``(tokens,)``, row ``i`` the next ``lengths[i]`` of them), no padding; ``None``
        where the packed route does not take the forward (:func:`.cpu_routes.packs`)."""
        dtype = self.embeddings.word_embeddings.weight.dtype
        kernels = cpu_routes.packs(int(lengths.max()), dtype)
        if kernels is None:
            return None
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        positions = np.arange(len(ids), dtype=np.int32) - np.repeat(offsets[:-1], lengths)
        types = np.zeros_like(ids) if type_ids is None else type_ids
        x = self.embeddings(mx.array(ids)[None], mx.array(types)[None],
                            mx.array(positions)[None])
        return self._layers(x, PackedRows(mx.array(offsets), kernels))[0]

    def _layers(self, x: mx.array, rows: Rows) -> mx.array:
        for layer in self.encoder.layer:
            # Evaluated layer by layer: left to order one graph of every layer, mlx kept
            # two layers' score matrices alive at once (the peak of a 256-token forward
            # of 32 heads: 22 MiB, against 13 evaluated so), past the memory estimate.
            x = layer(x, rows)
            mx.eval(x)
        return x

    def load_weights(self, file_or_weights: Any, strict: bool = True) -> "BertModel":
        """Load a checkpoint's tensors (under :func:`checkpoint_weights`' names), then
        fuse each layer's query, key and value projections."""
        super().load_weights(file_or_weights, strict=strict)
        for layer in self.encoder.layer:
            layer.attention.self_attn.fuse()
        return self

    def classify(self, first: mx.array) -> mx.array:
        """The classification logits ``(batch, num_labels)`` from the states of the rows'
        first tokens ``(batch, hidden)``."""
        if isinstance(self.classifier, RobertaClassificationHead):
            return self.classifier(first)
        return self.classifier(self.pooler(first))


def checkpoint_weights(weights: Mapping[str, mx.array], config: BertConfig) -> dict[str, mx.array]:
    """A Hugging Face BERT-family checkpoint's tensors under :class:`BertModel`'s names."""
    renamed = {}
    for name, value in weights.items():
        for prefix in ("bert.", "roberta.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.endswith("position_ids") or name.startswith(("lm_head.", "cls.")):
            continue
        if name.startswith("pooler.") and not (config.num_labels and
                                                config.model_type not in _OFFSET_POSITIONS):
            continue
        renamed[name.replace(".attention.self.", ".attention.self_attn.")] = value
    return renamed


__all__ = ["BERT_MODEL_TYPES", "BertConfig", "BertModel", "checkpoint_weights"]
