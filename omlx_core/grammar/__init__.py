"""Grammar-constrained decoding with xgrammar: compiled grammars per tokenizer, a
per-request constraint that masks one row of logits, and tool-call formats.

xgrammar is the optional ``grammar`` extra; it imports without torch thanks to
:mod:`omlx_core.grammar.torch_stub`, which :func:`import_xgrammar` installs first.
Importing this package does not import xgrammar. Tool-call formats, their grammars and
the streaming parser are in :mod:`omlx_core.grammar.toolcalls`. What a grammar may be is
capped (:mod:`~omlx_core.grammar.limits`), and compiles wait in a bounded, fair queue for
worker processes that stop them at their deadline (:mod:`~omlx_core.grammar.compile_queue`,
:mod:`~omlx_core.grammar.compile_worker`); :func:`~omlx_core.grammar.configure.configure_grammar`
applies a server's ``[grammar]`` settings.
"""

from omlx_core.grammar.compiler import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MAX_WHITESPACE,
    Compiled,
    CompilerStats,
    GrammarBusy,
    GrammarCompileTimeout,
    GrammarCompilerCache,
    GrammarError,
    GrammarSpec,
    GrammarUnavailable,
    compiler_for,
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
from omlx_core.grammar.xgrammar_import import import_xgrammar

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MAX_WHITESPACE",
    "Compiled",
    "CompilerStats",
    "GrammarBusy",
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
