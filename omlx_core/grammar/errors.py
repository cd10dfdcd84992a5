"""What goes wrong with a grammar, and what the HTTP front end answers for each: a
:class:`GrammarError` (and its :class:`GrammarCompileTimeout`) is the client's grammar
(400 naming its field and, for a cap, the setting that raises it); :class:`GrammarBusy`
is the server's compile queue, full now (503 with ``Retry-After``);
:class:`GrammarUnavailable` means xgrammar is not installed."""

from __future__ import annotations

__all__ = ["GrammarBusy", "GrammarCompileTimeout", "GrammarError", "GrammarUnavailable"]


class GrammarError(ValueError):
    """A grammar (schema, regex, EBNF, tool definition) that cannot be used, and which
    request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class GrammarCompileTimeout(GrammarError):
    """Compiling the grammar took longer than the compile time limit (or more memory
    than the compile memory limit): it was stopped."""


class GrammarUnavailable(RuntimeError):
    """xgrammar is not installed, so constrained decoding is off on this server."""


class GrammarBusy(Exception):
    """The compile queue has no room for this grammar now (it is full, or this client
    already has its share of it waiting); the same request may succeed later."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
