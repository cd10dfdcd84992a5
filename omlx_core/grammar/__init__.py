"""Grammar-constrained decoding with xgrammar: compiled grammars per tokenizer, a
per-request constraint that masks one row of logits, and tool-call formats.

xgrammar is the optional ``grammar`` extra; it imports without torch thanks to
:mod:`omlx_core.grammar.torch_stub`, which :func:`import_xgrammar` installs first.
Importing this package does not import xgrammar. Tool-call formats, their grammars and
the streaming parser are in :mod:`omlx_core.grammar.toolcalls`.
"""

from omlx_core.grammar.compiler import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_WHITESPACE,
    Compiled,
    CompilerStats,
    GrammarCompileTimeout,
    GrammarCompilerCache,
    GrammarError,
    GrammarSpec,
    GrammarUnavailable,
    compiler_for,
    import_xgrammar,
    json_safe_strings,
    special_token_ids,
    special_tokens,
)
from omlx_core.grammar.constraint import (
    GrammarConstraint,
    GrammarLogitsProcessor,
    apply_token_bitmask,
    mask_batch,
)

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_COMPILE_TIMEOUT_S",
    "DEFAULT_MAX_WHITESPACE",
    "Compiled",
    "CompilerStats",
    "GrammarCompileTimeout",
    "GrammarCompilerCache",
    "GrammarConstraint",
    "GrammarError",
    "GrammarLogitsProcessor",
    "GrammarSpec",
    "GrammarUnavailable",
    "apply_token_bitmask",
    "compiler_for",
    "import_xgrammar",
    "json_safe_strings",
    "mask_batch",
    "special_token_ids",
    "special_tokens",
]
