"""The built-in ``encoder`` engine: embeddings and reranking in the same model pool, under
the same memory guard, as the chat models.

Registered like any third-party plugin (entry point ``encoder`` in the ``omlx_core``
group):

- ``register_engines``: ``"encoder"`` -> :class:`~.engine.EncoderEngine`, an
  :class:`~omlx_core.encoding.EncodingEngine`. It serves BERT-family encoders written
  here on ``mlx.nn`` (:mod:`.bert`: BERT, MiniLM, RoBERTa, XLM-RoBERTa; a
  ``*ForSequenceClassification`` checkpoint is a cross-encoder reranker) from a
  sentence-transformers directory (:mod:`.layout`: pooling, normalisation, longest
  input), and decoders mlx-lm loads as embedders (last-token or mean pooling, an
  instruction before queries) or rerankers (yes/no logits), per ``[models.<id>] task``
  (:mod:`.backbone`);
- ``register_settings``: ``max_batch_tokens`` and ``max_batch_rows``, the caps of one
  forward; ``busy_share`` and ``busy_forward_ms``, how it paces itself while another
  engine (chat) has work on the MLX thread.

It needs no ``resolve_scheduler`` of its own: the engine reads its limits and forward
gate from ``host.memory``, where the built-in ``memory_guard`` plugin has them put.
Batching and the gate: :mod:`.engine`; which inputs share a forward: :mod:`.batching`.
Throughput: ``python -m benchmarks.embeddings``.
"""

from __future__ import annotations

from typing import Callable

from omlx_core.hookspecs import hookimpl
from omlx_core.plugins.encoder.engine import EncoderEngine
from omlx_core.settings import Setting

ENGINE_NAME = "encoder"

SETTINGS = (
    Setting("max_batch_tokens", "int", "most padded tokens (rows x longest row) one forward "
            "of an embedding or reranking model takes; inputs of every request share "
            "forwards up to it", minimum=16, maximum=1 << 20, default=4096),
    Setting("max_batch_rows", "int", "most inputs one forward takes", minimum=1,
            maximum=65536, default=256),
    Setting("busy_share", "float", "share of the MLX thread's time embedding and rerank "
            "forwards may take while another engine has work (chat streams keep their "
            "speed); alone they take all of it; 1: no pacing", minimum=0.01, maximum=1.0,
            default=0.1),
    Setting("busy_forward_ms", "float", "longest an embedding or rerank forward may take "
            "while another engine has work (the pause it adds between a chat's tokens), "
            "from measured forward times; one input longer than that still runs, alone",
            minimum=1.0, maximum=600000.0, default=100.0),
)


@hookimpl
def register_settings(register: Callable[[Setting], None]) -> None:
    for setting in SETTINGS:
        register(setting)


@hookimpl
def register_engines(register: Callable[..., None]) -> None:
    register(ENGINE_NAME, EncoderEngine)


__all__ = ["ENGINE_NAME", "EncoderEngine", "SETTINGS"]
