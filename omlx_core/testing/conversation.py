"""An agent-style conversation that re-sends its whole history every turn, and how much
of what the server saw on one turn the next turn reuses from the prefix cache.

Each turn's prompt is the chat template over every message so far (the previous
prompt's messages, the answer decoded to text, a new user message). What the server
saw on turn N is its prompt and completion (the stop token included: the engine feeds
it before the request ends); turn N+1 shares the longest token prefix of that with its
own prompt, and reuses ``usage.cached_tokens`` of it. :func:`run_conversation` returns
both per turn; :attr:`Turn.reuse` is their ratio.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.scheduling.block_hashes import common_prefix_length
from omlx_core.testing import engine_io

SYSTEM_PROMPT = ("You are a careful assistant for a team of engineers. Answer in short "
                 "sentences, name the tool you would use, and say when you are unsure. ") * 3

_TOPICS = ("the build cache", "a flaky test", "the memory guard", "a slow query",
           "the release notes", "a failing deploy", "the on-call rota", "a config change",
           "the disk quota", "an API version")

_ids = itertools.count()


def user_message(turn: int) -> str:
    """The user's message of ``turn`` (0-based): different every turn, deterministic."""
    topic = _TOPICS[turn % len(_TOPICS)]
    return (f"Turn {turn + 1}: what should we check first about {topic}, and what would "
            f"you change if it happened again next week?")


@dataclass(frozen=True)
class Turn:
    """One turn after the first: its prompt's length, the tokens it shares with what the
    server saw on the turn before, and how many of its prompt tokens came from cache."""

    prompt_tokens: int
    shared_tokens: int
    cached_tokens: int

    @property
    def reuse(self) -> float:
        """Cached tokens over shared tokens (1.0 when nothing is shared)."""
        return self.cached_tokens / self.shared_tokens if self.shared_tokens else 1.0


@dataclass(frozen=True)
class Conversation:
    """Every turn after the first, and the token ids each turn answered."""

    turns: list[Turn]
    answers: list[list[int]]

    @property
    def worst_reuse(self) -> float:
        return min((t.reuse for t in self.turns), default=1.0)


def run_conversation(engine: Any, tokenizer: Any, *, turns: int = 8, max_tokens: int = 24,
                     system_prompt: str = SYSTEM_PROMPT) -> Conversation:
    """Hold a ``turns``-turn greedy conversation with ``engine`` (an omlx-core engine,
    started), re-sending the history through ``tokenizer``'s chat template every turn."""
    messages = [{"role": "system", "content": system_prompt}]
    stop_ids = set(tokenizer.eos_token_ids)
    seen: list[int] = []
    measured: list[Turn] = []
    answers: list[list[int]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(turn)})
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        request = GenerationRequest(f"turn-{next(_ids)}", prompt,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
        tokens, last = [], None
        for output in engine_io.collect(engine.submit(request)):
            tokens += output.token_ids
            last = output
        if last is None or last.error:
            raise RuntimeError(f"turn {turn + 1} failed: {getattr(last, 'error', 'no output')}")
        if turn:
            measured.append(Turn(len(prompt), common_prefix_length(seen, prompt),
                                 last.usage.cached_tokens))
        answers.append(tokens)
        stop = [next(iter(stop_ids))] if last.finish_reason == "stop" and stop_ids else []
        seen = prompt + tokens + stop
        messages.append({"role": "assistant", "content": tokenizer.decode(tokens)})
    return Conversation(measured, answers)


def reuse_table(rows: Sequence[tuple[str, Conversation]]) -> str:
    """A text table: per conversation, each turn's reuse and the worst."""
    width = max((len(c.turns) for _, c in rows), default=0)
    header = ["model"] + [f"t{i + 2}" for i in range(width)] + ["worst"]
    lines = ["  ".join(f"{h:>10}" for h in header)]
    for name, conversation in rows:
        cells = [f"{t.cached_tokens}/{t.shared_tokens}" for t in conversation.turns]
        lines.append("  ".join(f"{c:>10}" for c in [name, *cells, f"{conversation.worst_reuse:.1%}"]))
    return "\n".join(lines)


__all__ = ["Conversation", "SYSTEM_PROMPT", "Turn", "reuse_table", "run_conversation", "user_message"]
