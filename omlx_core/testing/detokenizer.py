"""A streaming detokenizer over a fixed table of token texts, for scripted test engines.

It keeps mlx-lm's interface (``reset``, ``add_token``, ``finalize``, ``last_segment``)
so the pipeline's output processor reads it as it reads a real one.
"""

from __future__ import annotations

from typing import Mapping


class TableDetokenizer:
    """Token ``t`` reads as ``table[t]`` (``"<t>"`` when the table does not name it)."""

    def __init__(self, table: Mapping[int, str]) -> None:
        self.table = dict(table)
        self.reset()

    def reset(self) -> None:
        self.text = ""
        self.tokens: list[int] = []
        self._offset = 0

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.text += self.table.get(token, f"<{token}>")

    def finalize(self) -> None:
        """Nothing is held back: every token's text is whole."""

    @property
    def last_segment(self) -> str:
        segment = self.text[self._offset:]
        self._offset = len(self.text)
        return segment


__all__ = ["TableDetokenizer"]
