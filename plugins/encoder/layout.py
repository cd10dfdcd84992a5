"""What a model directory is as an embedder or reranker: its backbone (a BERT-family
encoder written here, or a decoder mlx-lm loads), its task, pooling, normalisation,
longest input and instruction, read before a byte of weights is.

A sentence-transformers directory says most of it: ``modules.json`` lists its
``Transformer``, ``Pooling`` (``1_Pooling/config.json``: mean, cls, max, last token)
and ``Normalize`` modules, ``sentence_bert_config.json`` its ``max_seq_length``. A
``*ForSequenceClassification`` checkpoint is a cross-encoder (task ``rerank``). A
model's ``[models.<id>]`` table (``task``, ``pooling``, ``normalize``, ``instruction``,
``matryoshka``) wins over what the directory says; a decoder (any model mlx-lm loads)
must be given its task there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from omlx_core.models.errors import ModelError
from omlx_core.plugins.encoder.bert import BERT_MODEL_TYPES

#: the instruction a decoder reranker is given when its model names none (Qwen3-Reranker's)
DEFAULT_RERANK_INSTRUCTION = ("Given a web search query, retrieve relevant passages that "
                              "answer the query")
_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
_MODULE_TYPES = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                 "sentence_transformers.models.Normalize"}


@dataclass(frozen=True)
class EncoderLayout:
    """One model as the encoder engine serves it."""

    #: ``"bert"`` (this plugin's mlx.nn encoder) or ``"decoder"`` (an mlx-lm model)
    backbone: str
    #: ``"embed"`` or ``"rerank"``
    task: str
    pooling: str
    normalize: bool
    #: longest input in tokens, special tokens included (``None``: the model's own)
    max_length: int | None
    #: put before every query (decoder embedders, Qwen3-Embedding style) or into the
    #: reranking prompt (decoder rerankers); ``None``: none
    instruction: str | None
    matryoshka: bool
    #: a sequence-classification head scores query/document pairs (cross-encoder)
    classifier: bool = False
    #: a cross-encoder's score: the sigmoid of its logit, or the logit itself
    sigmoid: bool = True

    @property
    def scoring(self) -> str:
        """How a rerank score is made, in the words a response carries."""
        if self.task == "embed":
            return "cosine"
        return "cross_encoder" if self.backbone == "bert" else "yes_no_logits"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} cannot be read as JSON: {exc}") from None


def sentence_transformers_modules(path: Path) -> dict[str, Any]:
    """What ``modules.json`` and its modules' configs say (empty: not such a directory)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelError(f"{modules_file} is not a list of modules")
    found: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind not in _MODULE_TYPES:
            raise ModelError(f"{modules_file}: module type {kind!r} is not supported by the "
                             f"encoder engine (it runs {', '.join(sorted(_MODULE_TYPES))})")
        if kind.endswith(".Normalize"):
            found["normalize"] = True
        elif kind.endswith(".Pooling"):
            found["pooling"] = _pooling_mode(path / str(module.get("path", "")) / "config.json")
    bert_config = path / "sentence_bert_config.json"
    if bert_config.is_file():
        length = _read_json(bert_config).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            found["max_length"] = length
    return found


def _pooling_mode(config_file: Path) -> str:
    config = _read_json(config_file) if config_file.is_file() else {}
    for key in _UNSUPPORTED_POOLING:
        if config.get(key):
            raise ModelError(f"{config_file}: {key} is not supported (the encoder engine pools "
                             "by mean, cls or last token)")
    modes = [mode for key, mode in _POOLING_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise ModelError(f"{config_file} must set exactly one pooling mode "
                         f"({', '.join(_POOLING_MODES)})")
    return modes[0]


def is_encoder_directory(path: Path, model_config: Mapping[str, Any]) -> bool:
    """Whether a model directory is an embedder or reranker by itself (a
    sentence-transformers directory, a BERT-family checkpoint)."""
    return ((path / "modules.json").is_file()
            or str(model_config.get("model_type", "")) in BERT_MODEL_TYPES)


def read_layout(path: Path, model_config: Mapping[str, Any],
                setting: Callable[[str], Any]) -> EncoderLayout:
    """The layout of the model in ``path``; ``setting(key)`` reads its ``[models.<id>]``
    table (``None`` where unset).

    :raises ModelError: the directory, or the table, asks for what the engine cannot do.
    """
    model_type = str(model_config.get("model_type", ""))
    backbone = "bert" if model_type in BERT_MODEL_TYPES else "decoder"
    if model_type.startswith("modernbert"):
        raise ModelError(f"model_type {model_type!r} (ModernBERT) is not supported by the "
                         "encoder engine yet; it serves BERT, MiniLM, RoBERTa and XLM-RoBERTa "
                         "encoders, and decoders mlx-lm loads")
    modules = sentence_transformers_modules(path)
    architectures = [str(a) for a in model_config.get("architectures") or []]
    classifier = backbone == "bert" and any(a.endswith("ForSequenceClassification")
                                            for a in architectures)
    task = setting("task") or ("rerank" if classifier else "embed" if backbone == "bert" else None)
    if task not in ("embed", "rerank"):
        raise ModelError(f"the encoder engine serves models for task 'embed' or 'rerank', not "
                         f"{task!r}; set task in the model's [models.<id>] table")
    if backbone == "bert" and task == "rerank" and not classifier:
        raise ModelError("a BERT-family model reranks with a sequence-classification head "
                         "(architectures *ForSequenceClassification); this one has none: "
                         "serve it with task = \"embed\" (rerank then scores by cosine)")
    if classifier and task == "embed":
        raise ModelError("a cross-encoder (*ForSequenceClassification) scores pairs; it does "
                         "not embed: serve it with task = \"rerank\"")
    pooling = setting("pooling") or modules.get("pooling") or ("last" if backbone == "decoder"
                                                              else "mean")
    normalize = setting("normalize")
    if normalize is None:
        normalize = modules.get("normalize", True) if modules else True
    instruction = setting("instruction") or None
    if task == "rerank" and backbone == "decoder" and instruction is None:
        instruction = DEFAULT_RERANK_INSTRUCTION
    sigmoid = True
    hint = model_config.get("sentence_transformers")
    if isinstance(hint, dict) and str(hint.get("activation_fn", "")).endswith("Identity"):
        sigmoid = False
    declared = bool(model_config.get("matryoshka_dimensions"))
    return EncoderLayout(backbone=backbone, task=task, pooling=pooling, normalize=bool(normalize),
                         max_length=modules.get("max_length"), instruction=instruction,
                         matryoshka=bool(setting("matryoshka") or declared),
                         classifier=classifier, sigmoid=sigmoid)


__all__ = ["DEFAULT_RERANK_INSTRUCTION", "EncoderLayout", "is_encoder_directory", "read_layout",
           "sentence_transformers_modules"]
