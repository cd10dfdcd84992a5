"""Tiny, seeded, random-weight models of real mlx-lm families for tests and examples,
and the engine host tests build engines with (:func:`make_test_host`).

Each model is a directory in mlx-lm format with a real byte-level BPE tokenizer and a
ChatML chat template, loaded through the same loader as a real checkpoint.
"""

from omlx_core.testing.host import make_test_host
from omlx_core.testing.models import (
    FAMILIES,
    SMALL,
    build_model,
    build_weights,
    cached_model,
    family_config,
)
from omlx_core.testing.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tokenizer,
    special_token_id,
)

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SMALL",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_model",
    "build_tokenizer",
    "build_weights",
    "cached_model",
    "family_config",
    "make_test_host",
    "special_token_id",
]
