"""A server's ``[grammar]`` settings, put in force for the whole process: the caps every
grammar is checked against, the compile queue and its workers, the compiled-grammar
caches' byte budget."""

from __future__ import annotations

from typing import Any

from omlx_core.grammar.compile_queue import CompileSettings, configure_compiles
from omlx_core.grammar.compiler import configure_cache_bytes
from omlx_core.grammar.limits import GrammarLimits, configure_limits

__all__ = ["configure_grammar"]


def configure_grammar(config: Any) -> None:
    """Apply ``config``'s ``grammar.*`` (the server calls this before it serves)."""
    configure_limits(GrammarLimits.from_config(config))
    configure_compiles(CompileSettings.from_config(config))
    configure_cache_bytes(int(config["grammar.cache_size"]))
