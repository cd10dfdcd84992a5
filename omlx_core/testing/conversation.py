"""An agent-style conversation that re-sends its whole history every turn, and how much
of what the server saw on one turn the next turn reuses from the prefix cache.

Each turn's prompt is the chat template over every message so far (the previous
prompt's messages, the answer decoded to text, a new user message). What the server
saw on turn N is its prompt and completion (the stop token included: the engine feeds
it before the request ends); turn N+1 shares the longest token prefix of that with its
own prompt, and reuses ``usage.cached_tokens`` of it. :func:`converse` returns both per
turn; :attr:`Turn.reuse` is their ratio.

Who answers is an :data:`Ask`: :func:`engine_asker` submits to an omlx-core engine in
this process, :func:`http_asker` sends the messages to a server's chat endpoint (with
the openai SDK) and reads its answer's token ids from the logprobs. An ask may start a
new server for each turn: then every turn's reuse is what the SSD tier kept across the
restart.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

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


def with_tool_output(model_dir: Path, tokens: int) -> Callable[[int], str]:
    """User messages that carry ``tokens`` tokens of tool output each (prose sized by the
    tokenizer in ``model_dir``, different every turn) after :func:`user_message`: the
    context an agent resends grows by that much every turn."""

    def message(turn: int) -> str:
        from omlx_core.bench.prompts import text_of_tokens

        output = text_of_tokens(model_dir, tokens, seed=1000 + turn, heading="Tool output:")
        return f"{user_message(turn)}\n\n{output}"

    return message


@dataclass(frozen=True)
class Reply:
    """One turn's answer as the server produced it."""

    #: the completion's token ids (the stop token not among them)
    tokens: list[int]
    #: the answer as text, as it goes back into the history
    text: str
    #: whether it ended on a stop token (which the engine fed, so the server saw it)
    stopped: bool
    #: prompt tokens the server took from its cache
    cached_tokens: int


#: answers ``(messages, prompt token ids)`` for one turn
Ask = Callable[[list[dict[str, str]], list[int]], Reply]


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


#: how each turn's messages follow from the turn before's (:func:`converse`):
#:
#: - ``"resend"``: the whole history, as it was, then the new message;
#: - ``"compacted"``: the history with the previous user message cut to a one-line stub
#:   (agents shorten tool output they have read), then the new message: the turn parts
#:   from what the server saw at the start of that message's text;
#: - ``"fresh"``: the system prompt and the new message alone (independent tasks under
#:   one system prompt): the turn parts from the last one after the system prompt.
SHAPES = ("resend", "compacted", "fresh")


def next_turn(messages: list[dict[str, str]], turn: int, text: str, shape: str = "resend") -> None:
    """Make ``messages`` (the system prompt, then each turn's user message and answer)
    turn ``turn``'s (0-based) as ``shape`` says (:data:`SHAPES`), its new user message
    ``text``."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {', '.join(SHAPES)}")
    if shape == "fresh":
        del messages[1:]
    elif shape == "compacted" and turn:
        messages[-2] = {"role": "user", "content": f"(tool output of turn {turn} read and cut)"}
    messages.append({"role": "user", "content": text})


def converse(ask: Ask, tokenizer: Any, *, turns: int = 8, system_prompt: str = SYSTEM_PROMPT,
             message: Callable[[int], str] = user_message, shape: str = "resend") -> Conversation:
    """Hold a ``turns``-turn conversation through ``ask``, re-sending the history through
    ``tokenizer``'s chat template (mlx-lm's tokenizer wrapper) every turn as ``shape``
    says (:data:`SHAPES`); ``message`` gives the user's message of each turn (0-based)."""
    messages = [{"role": "system", "content": system_prompt}]
    stop_ids = sorted(tokenizer.eos_token_ids)
    seen: list[int] = []
    measured: list[Turn] = []
    answers: list[list[int]] = []
    for turn in range(turns):
        next_turn(messages, turn, message(turn), shape)
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        reply = ask(list(messages), prompt)
        if turn:
            measured.append(Turn(len(prompt), common_prefix_length(seen, prompt),
                                 reply.cached_tokens))
        answers.append(reply.tokens)
        seen = prompt + reply.tokens + (stop_ids[:1] if reply.stopped and stop_ids else [])
        messages.append({"role": "assistant", "content": reply.text})
    return Conversation(measured, answers)


def engine_asker(engine: Any, tokenizer: Any, max_tokens: int = 24) -> Ask:
    """Greedy turns on ``engine`` (an omlx-core engine, started), by token ids."""

    def ask(messages: list[dict[str, str]], prompt: list[int]) -> Reply:
        # The cache points the serving pipeline would give the request.
        request = GenerationRequest(f"turn-{next(_ids)}", prompt,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                    cache_points=engine.cache_points(messages, prompt))
        tokens, last = [], None
        for output in engine_io.collect(engine.submit(request)):
            tokens += output.token_ids
            last = output
        if last is None or last.error:
            raise RuntimeError(f"the turn failed: {getattr(last, 'error', 'no output')}")
        return Reply(tokens, tokenizer.decode(tokens), last.finish_reason == "stop",
                     last.usage.cached_tokens)

    return ask


def http_asker(client: Any, model: str, model_dir: Path, max_tokens: int = 24) -> Ask:
    """Greedy turns through ``client`` (an ``openai.OpenAI``) on a server's chat endpoint.
    The answer's token ids come from its logprobs (each token's exact bytes, looked up in
    the byte-level BPE vocabulary of ``model_dir``): the text encoded again can split
    differently from what the model generated, and the shared prefix must be measured
    against the tokens the server saw."""
    ids_of = _ids_by_bytes(model_dir)

    def ask(messages: list[dict[str, str]], prompt: list[int]) -> Reply:
        response = client.chat.completions.create(model=model, messages=messages,
                                                  max_tokens=max_tokens, temperature=0,
                                                  logprobs=True)
        choice, usage = response.choices[0], response.usage
        entries = choice.logprobs.content if choice.logprobs is not None else []
        tokens = [ids_of[bytes(entry.bytes)] for entry in entries or ()]
        stopped = choice.finish_reason == "stop"
        # A stop token is counted in the usage but has no text, so no logprobs entry.
        counted = len(tokens) + (1 if stopped else 0)
        if usage.prompt_tokens != len(prompt) or usage.completion_tokens not in (len(tokens), counted):
            raise RuntimeError(f"the server saw {usage.prompt_tokens} prompt and "
                               f"{usage.completion_tokens} completion tokens, the template and "
                               f"the logprobs give {len(prompt)} and {len(tokens)}")
        details = usage.prompt_tokens_details
        cached = int(details.cached_tokens or 0) if details is not None else 0
        return Reply(tokens, choice.message.content or "", stopped, cached)

    return ask


def _ids_by_bytes(model_dir: Path) -> dict[bytes, int]:
    from tokenizers import Tokenizer

    from omlx_core.models.tokens import token_texts

    texts = token_texts(model_dir)
    size = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size()
    return {texts.bytes_of(i): i for i in reversed(range(size))}


def run_conversation(engine: Any, tokenizer: Any, *, turns: int = 8, max_tokens: int = 24,
                     system_prompt: str = SYSTEM_PROMPT, shape: str = "resend") -> Conversation:
    """:func:`converse` with greedy turns on ``engine`` (an omlx-core engine, started)."""
    return converse(engine_asker(engine, tokenizer, max_tokens), tokenizer, turns=turns,
                    system_prompt=system_prompt, shape=shape)


def reuse_table(rows: Sequence[tuple[str, Conversation]]) -> str:
    """A text table: per conversation, each turn's reuse and the worst."""
    width = max((len(c.turns) for _, c in rows), default=0)
    header = ["model"] + [f"t{i + 2}" for i in range(width)] + ["worst"]
    lines = ["  ".join(f"{h:>10}" for h in header)]
    for name, conversation in rows:
        cells = [f"{t.cached_tokens}/{t.shared_tokens}" for t in conversation.turns]
        lines.append("  ".join(f"{c:>10}" for c in [name, *cells, f"{conversation.worst_reuse:.1%}"]))
    return "\n".join(lines)


__all__ = ["Ask", "Conversation", "Reply", "SHAPES", "SYSTEM_PROMPT", "Turn", "converse", "engine_asker",
           "http_asker", "next_turn", "reuse_table", "run_conversation", "user_message",
           "with_tool_output"]
