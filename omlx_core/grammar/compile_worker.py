"""One process that compiles grammars first, and its pipe: so a compile can be stopped.

xgrammar has no way to interrupt a compile, and a thread cannot be killed: a compile
that outlived its request kept its CPU and memory until it ended (an ``enum`` of 60,000
strings: seconds, and hundreds of MiB that then stayed with the server). So every new
grammar is compiled first in a process of its own, which is killed (SIGKILL: all it held
goes back to the system at once) past its deadline or its memory limit. Only a grammar
that compiled there within both is compiled again in the server, where it then takes the
time and memory it took there. A compiled grammar is not sent back: xgrammar's
serialization of one can be hundreds of times its size (an EBNF of 2,000 alternatives:
0.8 MiB compiled, 200 MiB of JSON and 14 s to write it).

The child (:func:`main` in a fresh interpreter) imports xgrammar (through the torch stub,
with an inert ``transformers``) and nothing of mlx. The parent sends it each tokenizer once
(``TokenizerInfo.serialize_json``) and then grammars to compile; it answers with how long
the compile took and the compiled grammar's size. Every message on the pipe is a 4-byte
length, a JSON header of at most :data:`MAX_HEADER_BYTES`, and a payload whose length
the header states: no pickle, and nothing a peer sends is evaluated.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from typing import Any, BinaryIO

from omlx_core.grammar.xgrammar_import import import_xgrammar
from omlx_core.memory.usage import count_helper_process, forget_helper_process

__all__ = ["CompileFailed", "CompileKilled", "CompileWorker", "WorkerOutput", "compile_request"]

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024 * 1024
#: the largest payload: a tokenizer's serialized vocabulary
MAX_PAYLOAD_BYTES = 1024**3
#: how often the parent looks at the child's memory while it compiles
POLL_S = 0.05
#: tokenizers a child keeps compilers for (each holds its vocabulary's tables)
CHILD_TOKENIZERS = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# -- the pipe -------------------------------------------------------------------------------


def write_message(stream: BinaryIO, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps({**header, "payload": len(payload)}).encode()
    stream.write(struct.pack(">I", len(head)) + head + payload)
    stream.flush()


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the pipe closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(stream: BinaryIO) -> tuple[dict[str, Any], bytes]:
    """One message; ``EOFError`` when the pipe is closed, ``ValueError`` when it is not
    a message of this protocol."""
    (size,) = struct.unpack(">I", _read_exactly(stream, 4))
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {size} bytes, over {MAX_HEADER_BYTES}")
    header = json.loads(_read_exactly(stream, size))
    if not isinstance(header, dict) or not isinstance(header.get("payload"), int):
        raise ValueError("a header that is not an object with a payload length")
    length = header["payload"]
    if not 0 <= length <= MAX_PAYLOAD_BYTES:
        raise ValueError(f"a payload of {length} bytes")
    return header, _read_exactly(stream, length)


# -- the parent's side ------------------------------------------------------------------------


class CompileFailed(Exception):
    """The child could not compile the grammar; the message is xgrammar's."""


class CompileKilled(Exception):
    """The compile was stopped: ``reason`` is ``"deadline"`` or ``"memory"``."""

    def __init__(self, reason: str, seconds: float, peak_bytes: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.seconds = seconds
        self.peak_bytes = peak_bytes


@dataclass(frozen=True)
class WorkerOutput:
    """What compiling a grammar took in the child."""

    seconds: float
    #: ``CompiledGrammar.memory_size_bytes`` in the child
    memory_bytes: int
    #: the child's resident set at its largest during the compile
    peak_bytes: int


class CompileWorker:
    """A child process that compiles grammars one at a time (use it from one thread)."""

    def __init__(self, name: str = "grammar-compile") -> None:
        self.name = name
        self._process: subprocess.Popen | None = None
        self._tokenizers: set[str] = set()
        #: the child's resident set when it had just started (what a compile adds on top)
        self.idle_bytes = 0
        self.compiles = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the child (and wait until it has imported xgrammar)."""
        if self.running:
            return
        self.stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._process = subprocess.Popen(
            # Not ``-m``: the package imports this module first, and runpy warns of that
            # on every start.
            [sys.executable, "-c", "import sys; from omlx_core.grammar.compile_worker "
             "import main; sys.exit(main())"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env, bufsize=0,
            start_new_session=True)  # a Ctrl-C to the server is the server's to handle
        count_helper_process(self._process.pid)
        header, _ = self._receive(None)
        if header.get("ready") is not True:
            raise CompileFailed(f"the compile worker did not start: {header.get('error')}")
        self.idle_bytes = self.resident_bytes()

    def stop(self) -> None:
        """End the child at once (its memory goes back to the system)."""
        process, self._process = self._process, None
        self._tokenizers.clear()
        if process is None:
            return
        forget_helper_process(process.pid)
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()

    def resident_bytes(self) -> int:
        """The child's resident set now (0 when it is not running)."""
        pid = self.pid
        if pid is None:
            return 0
        try:
            with open(f"/proc/{pid}/statm", "rb") as statm:
                return int(statm.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return 0

    def compile(self, tokenizer_key: str, tokenizer_info: Any, request: dict[str, Any], *,
                deadline_s: float, memory_limit: int) -> WorkerOutput:
        """Compile ``request`` (kind, source, options) for the tokenizer ``tokenizer_key``
        (``tokenizer_info()`` gives its serialized info when the child does not have it).

        :raises CompileKilled: past ``deadline_s`` or ``memory_limit`` bytes over the
            child's idle size; the child was killed.
        :raises CompileFailed: xgrammar refused the grammar (the child stays).
        """
        self.start()
        started = time.monotonic()
        assert self._process is not None and self._process.stdin is not None
        if tokenizer_key not in self._tokenizers:
            write_message(self._process.stdin, {"op": "tokenizer", "key": tokenizer_key},
                          tokenizer_info().encode())
            self._tokenizers.add(tokenizer_key)
        write_message(self._process.stdin, {"op": "compile", "tokenizer": tokenizer_key, **request})
        peak = [0]

        def watch() -> str | None:
            used = self.resident_bytes()
            peak[0] = max(peak[0], used)
            if used - self.idle_bytes > memory_limit:
                return "memory"
            if time.monotonic() - started > deadline_s:
                return "deadline"
            return None

        header, payload = self._receive(watch)
        self.compiles += 1
        if not header.get("ok"):
            raise CompileFailed(str(header.get("error", "the compile failed")))
        return WorkerOutput(float(header["seconds"]), int(header["memory_bytes"]), peak[0])

    def _receive(self, watch: Any) -> tuple[dict[str, Any], bytes]:
        process = self._process
        assert process is not None and process.stdout is not None
        started = time.monotonic()
        while True:
            readable, _, _ = select.select([process.stdout], [], [], POLL_S)
            if readable:
                break
            reason = watch() if watch is not None else None
            if reason is None and process.poll() is not None:
                reason = "crash"
            if reason is not None:
                peak = self.resident_bytes()
                self.stop()
                raise CompileKilled(reason, time.monotonic() - started, peak)
        try:
            return read_message(process.stdout)
        except (EOFError, ValueError) as exc:  # the child died (a crash in xgrammar)
            self.stop()
            raise CompileKilled("crash", time.monotonic() - started, 0) from exc


# -- the child's side -------------------------------------------------------------------------


def compile_request(compiler: Any, request: dict[str, Any]) -> Any:
    """``request`` (kind, source and options, as the parent sends them) compiled by the
    ``xgrammar.GrammarCompiler`` ``compiler``: the same in the child and in the server."""
    kind, source = request["kind"], request["source"]
    if kind == "json_schema":
        return compiler.compile_json_schema(source, strict_mode=bool(request["strict"]),
                                            any_whitespace=True,
                                            max_whitespace_cnt=request.get("max_whitespace"))
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "ebnf":
        return compiler.compile_grammar(source)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(source)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _without_transformers() -> None:
    """Give xgrammar an inert ``transformers`` to import in this child (0.2.x imports
    three names of it: ``tokenizer_info``'s checks of Hugging Face tokenizers and
    ``contrib.hf``'s logits processor); the child builds every
    tokenizer from the parent's serialized ``TokenizerInfo`` and never a Hugging Face
    one, and the real import took 31 MiB of its 89 MiB idle resident set and 0.8 s of
    its 1.2 s start (measured), paid again at every restart after the memory guard
    stopped an idle worker. A name a later xgrammar imports beyond these fails the
    start, which the parent reports."""
    if "transformers" in sys.modules:
        return
    module = types.ModuleType("transformers")
    module.__doc__ = "omlx-core's compile worker: no Hugging Face tokenizers here"
    base = type("PreTrainedTokenizerBase", (), {})
    module.PreTrainedTokenizerBase = base
    module.PreTrainedTokenizerFast = type("PreTrainedTokenizerFast", (base,), {})
    module.LogitsProcessor = type("LogitsProcessor", (), {})
    sys.modules["transformers"] = module


def child_main(stdin: BinaryIO, stdout: BinaryIO) -> int:
    """Compile what the parent sends until it closes the pipe."""
    try:
        _without_transformers()
        xgr = import_xgrammar()
    except Exception as exc:  # reported to the parent, which names it
        write_message(stdout, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    write_message(stdout, {"ready": True})
    compilers: dict[str, Any] = {}
    while True:
        try:
            header, payload = read_message(stdin)
        except EOFError:
            return 0
        if header.get("op") == "tokenizer":
            info = xgr.TokenizerInfo.deserialize_json(payload.decode())
            compilers[str(header["key"])] = xgr.GrammarCompiler(info, max_threads=2,
                                                                cache_enabled=False)
            while len(compilers) > CHILD_TOKENIZERS:
                compilers.pop(next(iter(compilers)))
            continue
        started = time.perf_counter()
        try:
            grammar = compile_request(compilers[str(header["tokenizer"])], header)
        except Exception as exc:  # xgrammar's refusal of the grammar: the parent's 400
            write_message(stdout, {"ok": False, "error": str(exc) or type(exc).__name__})
            continue
        write_message(stdout, {"ok": True, "seconds": time.perf_counter() - started,
                               "memory_bytes": int(grammar.memory_size_bytes)})
        del grammar


def main() -> int:
    # The pipe to the parent is a duplicate of stdout; stdout itself goes to stderr, so
    # nothing a library prints can corrupt a message.
    pipe = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    return child_main(sys.stdin.buffer, pipe)


if __name__ == "__main__":
    sys.exit(main())
