"""Grammar-constrained decoding with xgrammar: compiled grammars per tokenizer, a
per-request constraint that masks one row of logits, and tool-call formats.

xgrammar is the optional ``grammar`` extra; it imports without torch thanks to
:mod:`omlx_core.grammar.torch_stub`, which :func:`import_xgrammar` installs first.
Importing this package does not import xgrammar.
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
)
from omlx_core.grammar.constraint import GrammarConstraint, GrammarLogitsProcessor, apply_token_bitmask

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
]
