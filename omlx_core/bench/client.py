"""A timing client for OpenAI-style streaming chat completions, shared by the benchmarks.

Every SSE chunk that carries generated text is time-stamped on arrival, so one record
gives the time to first token and the gaps between tokens. Token counts come from the
final ``usage`` chunk (``stream_options.include_usage``), which both omlx-core and
``mlx_lm.server`` send; a stream cut short counts its text chunks instead.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

# OpenAI's logit_bias range ends at -100; after softmax that is a probability of ~e-44.
BANNED_BIAS = -100.0
# Errors before the response's status line: the server dropped the connection without
# reading the request (e.g. a full listen backlog). OpenAI's SDKs retry these, so do we.
CONNECT_ERRORS = (ConnectionResetError, ConnectionRefusedError, BrokenPipeError,
                  http.client.RemoteDisconnected)
CONNECT_RETRIES = 3


@dataclass
class StreamRecord:
    """What one streamed request produced, with arrival times (``time.perf_counter``)."""

    started: float
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finished: float = 0.0
    #: False when the reader stopped early (``stop`` was set) instead of reading ``[DONE]``
    complete: bool = False
    #: times the connection was dropped before a response and the request sent again
    retries: int = 0
    #: ``finish_reason`` of the last choice (``stop`` for a natural end, ``length``)
    finish_reason: str | None = None
    #: drafted and accepted tokens from the usage's ``speculative`` object; ``None`` when
    #: the server's usage has none (it drafted nothing, or does not report drafts)
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None

    @property
    def ttft(self) -> float:
        """Seconds from sending the request to the first chunk of generated text."""
        if not self.chunk_times:
            raise RuntimeError("the stream produced no text, so it has no time to first token")
        return self.chunk_times[0] - self.started

    @property
    def decode_rate(self) -> float:
        """Tokens per second from the first text chunk to the last: the tokens after the
        first over that span (``nan`` for a stream of one chunk)."""
        span = self.chunk_times[-1] - self.chunk_times[0] if self.chunk_times else 0.0
        return (self.completion_tokens - 1) / span if span > 0 else float("nan")

    @property
    def end_to_end_rate(self) -> float:
        """Completion tokens per second from sending the request to reading its end."""
        return self.completion_tokens / (self.finished - self.started)

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive text chunks (inter-token latency)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def special_token_ids(model_dir: Path) -> list[int]:
    """Ids of a model's special tokens (end-of-sequence among them), from tokenizer.json."""
    spec = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    return sorted(int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special"))


def chat_body(model: str, messages: Sequence[dict[str, str]], max_tokens: int,
              banned_token_ids: Sequence[int] = (), temperature: float = 0.0) -> dict[str, Any]:
    """A streaming chat-completion request. Banning the special tokens makes every stream
    run to exactly ``max_tokens``, but a server pays for the bias as it applies logits
    processors (``mlx_lm.server`` per row, per step): a comparison of two servers sends
    none and counts the tokens each stream produced."""
    body: dict[str, Any] = {
        "model": model, "messages": list(messages), "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
        "temperature": temperature}
    if banned_token_ids:
        body["logit_bias"] = {str(t): BANNED_BIAS for t in banned_token_ids}
    return body


def stream_chat(host: str, port: int, body: dict[str, Any], *,
                stop: threading.Event | None = None,
                on_text: Callable[[float], None] | None = None, timeout: float = 1800.0,
                path: str = "/v1/chat/completions") -> StreamRecord:
    """POST ``body`` and read its SSE stream to ``[DONE]`` (or until ``stop`` is set,
    then hang up, which both servers take as a cancellation). A connection dropped before
    any response is retried (``CONNECT_RETRIES`` times); the TTFT counts from the first try.

    :param on_text: called with the arrival time of each chunk that carries text.
    """
    payload = json.dumps(body).encode()
    record = StreamRecord(started=time.perf_counter())
    pieces: list[str] = []
    while True:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            connection.request("POST", path, body=payload,
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            break
        except CONNECT_ERRORS:
            connection.close()
            if record.retries == CONNECT_RETRIES:
                raise
            record.retries += 1
            time.sleep(0.25 * 2 ** record.retries)
    try:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status} from {host}:{port}{path}: "
                               f"{response.read()[:500]!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue  # blank separators and ": keepalive" comments
            now = time.perf_counter()
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                record.complete = True
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"in-band error from {host}:{port}: {event['error']}")
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
                text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if text:
                    record.chunk_times.append(now)
                    pieces.append(text)
                    if on_text is not None:
                        on_text(now)
            usage = event.get("usage")
            if usage:
                record.completion_tokens = int(usage["completion_tokens"])
                record.prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    record.cached_tokens = int(details["cached_tokens"])
                speculative = usage.get("speculative") or {}
                if speculative:
                    record.draft_tokens = int(speculative["drafted_tokens"])
                    record.accepted_draft_tokens = int(speculative["accepted_tokens"])
            if stop is not None and stop.is_set():
                break
    finally:
        connection.close()
    record.finished = time.perf_counter()
    record.text = "".join(pieces)
    if not record.completion_tokens:
        record.completion_tokens = len(record.chunk_times)
    return record


def run_concurrently(count: int, work: Callable[[int], T]) -> tuple[list[T], float]:
    """Run ``work(0) .. work(count - 1)`` on threads released at the same instant.

    :returns: the results in index order and the wall seconds from the release to the
        last one's end.
    :raises RuntimeError: naming the first index whose work raised.
    """
    results: list[Any] = [None] * count
    failures: dict[int, BaseException] = {}
    barrier = threading.Barrier(count + 1)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = work(index)
        except BaseException as exc:  # reported below, with the index it came from
            failures[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        index = min(failures)
        raise RuntimeError(f"stream {index} of {count} failed: {failures[index]!r}") \
            from failures[index]
    return results, elapsed
