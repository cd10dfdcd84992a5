"""Each security finding of the "hardened by default" issue, replayed against a server
started as the README starts it, before and after: the checkout given by ``--before``
and this one.

    python -m benchmarks.attacks [--before PATH] [--flood-s 120] [--flood-only] [--control]
        [--rounds N] [--distributed | --distributed-only] [--out FILE]

``--before`` is another checkout with its own virtualenv (``PATH/.venv``): the commit
before the change (``git archive <commit> | tar -x -C PATH``, then ``./setup.sh test
--co -q`` there). Each server is ``omlx-core serve`` on loopback with the default model
and the tier the machine picks, each on a fresh ``OMLX_CACHE_DIR`` sharing the converted
models; a second start per checkout adds what a finding needs (printed: an API key, a
broken model, a second model, a short keep-alive). The replays:

1. **grammar flood**: three clients loop chats whose ``json_schema`` is an ``enum`` of
   60,000 random 40-character strings for ``--flood-s`` seconds; meanwhile a fresh small
   ``json_schema`` chat, a tool-call chat and a plain chat, in turn. Reported: each kind's
   median and worst latency, the plain chat's median against its own idle median,
   the server's resident memory (its process and its children) at its largest during
   the flood and after, against before it, the part of that growth the prefix cache
   holds (the KV of the benchmark's own chats, kept up to the cache's budget and given
   back on demand) and the rest, and what the flood was answered. With ``--control``,
   each round (``--rounds``) also sends the same number of the same chats to a fresh
   server with no flood: the flood's own growth is the flooded server's less the
   control's, the median over the rounds;
2. **pickle between ranks, trust_remote_code**: what the checkout's distributed plugin
   calls (the tests feed the new decoder hostile bytes);
3. **localhost CSRF and DNS rebinding**: a chat posted without a Content-Type, an
   HTML form's unpin, a request with a foreign ``Host``;
4. **smaller holes**: the SSD cache's modes after a long prompt, ``/health`` and an
   admin action with only an API key on a server with keys, a load error's path in an
   answer, what ``cached_tokens`` tells a second, salted client, tool-call arguments
   nested 50,000 deep, ``memory.queue_timeout_s = nan``;
5. with ``--distributed``: ``mlx.launch -n 3 --backend ring -- omlx-core serve
   --distributed tensor`` with and without ``--tier cluster`` answering a 40-token chat
   (minutes each on two cores; ``--distributed-only`` replays just these);
6. **a streamed request's 413 after a 200**: a stream for a model that loads longer than
   the keep-alive (0.05 s here) and whose prompt cannot be served.

Timings are medians of the samples taken within one run (the idle and the flooded plain
chat on the same server), so the ratio compares like with like.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.ceiling import child_pids
from omlx_core.bench import publish_report
from omlx_core.bench.servers import fresh_cache_root, free_port, preload_env
from omlx_core.models.default import ensure_default_model
from omlx_core.testing import cached_model

MODEL = "smollm2-135m-instruct"
BEFORE, AFTER = "before", "after"
MIB = 1024 * 1024
KEY = "attacks-api-key"


# -- one server -----------------------------------------------------------------------------------


class Served:
    """``omlx-core serve`` of one checkout on a port of its own, until closed."""

    def __init__(self, python: str, checkout: Path, port: int, cache_root: Path,
                 extra: list[str]):
        self.port = port
        self.argv = [python, "-m", "omlx_core", "--log-level", "WARNING", "serve", "--host",
                     "127.0.0.1", "--port", str(port), *extra]
        self.log_path = Path(tempfile.mkstemp(prefix="omlx-attacks-", suffix=".log")[1])
        env = preload_env() | {"OMLX_CACHE_DIR": str(cache_root)}
        with open(self.log_path, "wb") as log:
            # In the checkout: ``python -m`` imports from the working directory first.
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, cwd=checkout,
                                            start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            try:
                if request(self, "GET", "/health", timeout=5)[0] in (200, 503):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("the server did not answer within 600 s")

    def tree_rss(self, children_only: bool = False) -> int:
        """Resident bytes of the server and its child processes (grammar workers, which
        the server's compile threads start: each thread's children are listed apart)."""
        pids = ([] if children_only else [self.process.pid]) + child_pids(self.process.pid)
        total = 0
        for pid in pids:
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                pass
        return total

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)


def request(server: Served | int, method: str, path: str, body: Any = None, *,
            headers: dict[str, str] | None = None, raw: bytes | None = None,
            timeout: float = 600) -> tuple[int, Any]:
    """One request to ``server`` (a :class:`Served` or a port): its status and body."""
    port = server if isinstance(server, int) else server.port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        sent = {"Content-Type": "application/json"} if payload is not None and raw is None else {}
        sent.update(headers or {})
        connection.request(method, path, body=payload, headers=sent)
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode(errors="replace")
    finally:
        connection.close()


def timed(server: Served | int, body: dict, **kwargs: Any) -> tuple[float, int, Any]:
    started = time.monotonic()
    status, answer = request(server, "POST", "/v1/chat/completions", body or None, **kwargs)
    return time.monotonic() - started, status, answer


def message_of(answer: Any) -> str:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message", ""))
    return str(answer)[:300]


# -- 1. the grammar flood -------------------------------------------------------------------------


def words(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters, k=40)) for _ in range(count)]


def chat(content: str, **extra: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 16, "temperature": 0, **extra}


def schema_chat(name: str) -> dict:
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    return chat("Give me a number as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})


def tool_chat(name: str) -> dict:
    tool = {"type": "function", "function": {"name": f"get_{name}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    return chat("What is the weather in Paris?", tools=[tool], tool_choice="required")


@dataclass
class FloodResult:
    idle_chat_s: list[float] = field(default_factory=list)
    flood_chat_s: list[float] = field(default_factory=list)
    schema_s: list[float] = field(default_factory=list)
    schema_ok: int = 0
    tool_s: list[float] = field(default_factory=list)
    tool_ok: int = 0
    flood_statuses: dict[int, int] = field(default_factory=dict)
    flood_named_cap: int = 0
    flood_s: list[float] = field(default_factory=list)
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    #: the prefix cache's bytes (``/health``): KV of the benchmark's own chats, which the
    #: server keeps up to its budget and gives back on demand
    prefix_before: int = 0
    prefix_after: int = 0
    #: the compile workers' part of rss_before and rss_after
    workers_before: int = 0
    workers_after: int = 0
    #: rounds of the three chats sent while it lasted
    turns: int = 0
    flooded: bool = True

    def growth_after(self) -> int:
        return self.rss_after - self.rss_before


def grammar_flood(server: Served, seconds: float, control_turns: int | None = None) -> FloodResult:
    """The flood for ``seconds``, the three chats sent in turn meanwhile; with
    ``control_turns``, no flood: that many turns of the same chats, to tell the flood's
    own memory from what the chats themselves leave (their KV, their grammars)."""
    result = FloodResult(flooded=control_turns is None)
    for i in range(3):
        result.idle_chat_s.append(timed(server, chat(f"Say hello {i}."))[0])
    # One structured and one tool request before the flood: what serving them costs
    # to start (a compile worker) is not the flood's.
    timed(server, schema_chat("warm"))
    timed(server, tool_chat("warm"))
    result.rss_before = server.tree_rss()
    result.prefix_before = prefix_cache_bytes(server)
    result.workers_before = server.tree_rss(children_only=True)
    stop = threading.Event()
    # Encoded once: the flooders' own work on this machine's cores stays small.
    flood_bodies = [json.dumps(chat("Pick one.", response_format={
        "type": "json_schema", "json_schema": {"name": "pick", "schema": {
            "type": "object", "properties": {"pick": {"enum": words(60_000, seed)}}}}})).encode()
        for seed in range(3)]
    lock = threading.Lock()

    def flooder(body: bytes) -> None:
        while not stop.is_set():
            took, status, answer = timed(server, {}, raw=body,
                                         headers={"Content-Type": "application/json"})
            with lock:
                result.flood_statuses[status] = result.flood_statuses.get(status, 0) + 1
                result.flood_s.append(took)
                result.flood_named_cap += "grammar." in message_of(answer)

    def sampler() -> None:
        while not stop.wait(0.5):
            result.rss_peak = max(result.rss_peak, server.tree_rss())

    threads = ([threading.Thread(target=flooder, args=(b,), daemon=True) for b in flood_bodies]
               if result.flooded else [])
    threads.append(threading.Thread(target=sampler, daemon=True))
    for thread in threads:
        thread.start()
    ends = time.monotonic() + seconds

    def going_on() -> bool:
        if control_turns is not None:
            return turn < control_turns
        return time.monotonic() < ends

    turn = 0
    while going_on():
        turn += 1
        took, status, _ = timed(server, schema_chat(f"n{turn}"))  # a new grammar each time
        result.schema_s.append(took)
        result.schema_ok += status == 200
        took, status, _ = timed(server, tool_chat(f"t{turn}"))
        result.tool_s.append(took)
        result.tool_ok += status == 200
        result.flood_chat_s.append(timed(server, chat(f"Say hello {turn}."))[0])
    result.turns = turn
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    time.sleep(2)
    result.rss_after = server.tree_rss()
    result.rss_peak = max(result.rss_peak, result.rss_after)
    result.prefix_after = prefix_cache_bytes(server)
    result.workers_after = server.tree_rss(children_only=True)
    return result


def prefix_cache_bytes(server: Served) -> int:
    """Bytes the served models' prefix caches hold (0 from a server that does not say)."""
    _, health = request(server, "GET", "/health")
    engines = health.get("engines", {}) if isinstance(health, dict) else {}
    return sum(int(stats.get("prefix_cache_bytes", 0) or 0) for stats in engines.values()
               if isinstance(stats, dict))


# -- the other findings ----------------------------------------------------------------------------


def csrf_and_rebinding(server: Served) -> dict[str, str]:
    body = json.dumps(chat("Hi")).encode()
    no_type, _ = request(server, "POST", "/v1/chat/completions", raw=body)
    form, _ = request(server, "POST", f"/admin/models/{MODEL}/unpin", raw=b"x=1",
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    request(server, "POST", f"/admin/models/{MODEL}/pin", {})  # as it was
    rebound, _ = request(server, "GET", "/v1/models", headers={"Host": "attacker.example:8000"})
    return {"chat posted without a Content-Type": str(no_type),
            "HTML form unpinning the model": str(form),
            "GET /v1/models with Host: attacker.example": str(rebound)}


def ssd_modes(cache_root: Path) -> str:
    """The modes under the SSD cache after a long prompt (its blocks written)."""
    modes = {oct(p.stat().st_mode & 0o777) for p in (cache_root / "ssd").rglob("*")}
    return ", ".join(sorted(modes)) or "nothing written"


def smaller_holes(server: Served, cache_root: Path) -> dict[str, str]:
    long_prompt = " ".join(f"word{i}" for i in range(400))
    request(server, "POST", "/v1/chat/completions", chat(long_prompt, max_tokens=1))
    time.sleep(2)  # the SSD writer's thread
    first = request(server, "POST", "/v1/chat/completions", chat(long_prompt + " again", max_tokens=1))
    second = request(server, "POST", "/v1/chat/completions",
                     chat(long_prompt + " again", max_tokens=1, cache_salt="another-client-5c1e"))
    cached = [answer.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
              if isinstance(answer, dict) else None for _, answer in (first, second)]
    deep = "[" * 50_000 + "]" * 50_000
    nested = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    deep_status, deep_answer = request(server, "POST", "/v1/chat/completions", nested)
    return {"SSD cache modes (dirs and files)": ssd_modes(cache_root),
            "cached_tokens a salted second client sees of another's prompt": str(cached[1]),
            "tool-call arguments nested 50,000 deep": f"{deep_status} "
                                                      f"({message_of(deep_answer)[:60]})"}


def keyed_server_holes(server: Served, broken: Path) -> dict[str, str]:
    anonymous = request(server, "GET", "/health")[1]
    shown = json.dumps(anonymous)
    unpin, _ = request(server, "POST", f"/admin/models/{MODEL}/unpin", {},
                       headers={"Authorization": f"Bearer {KEY}"})
    failed = request(server, "POST", "/v1/chat/completions", {**chat("hi"), "model": "broken"},
                     headers={"Authorization": f"Bearer {KEY}"})
    text = message_of(failed[1])
    return {"/health without a key (keys set): fields": ", ".join(sorted(anonymous))
            if isinstance(anonymous, dict) else shown[:60],
            "/health without a key names the broken model's path": str(str(broken) in shown),
            "admin unpin with an API key only": str(unpin),
            "a load error's answer names the model's absolute path": f"{failed[0]}, "
                                                                     f"{str(broken) in text}"}


def stream_after_load(server: Served) -> str:
    """A stream for a model loaded on demand whose prompt is over its context: the
    refusal's status, and whether a 200 came first."""
    body = {"model": "second", "stream": True, "max_tokens": 4,
            "prompt": list(range(3, 3 + 5000))}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json",
                                    "Authorization": f"Bearer {KEY}"})
        response = connection.getresponse()
        data = response.read().decode(errors="replace")
        in_band = "error" in data and response.status == 200
        return f"{response.status}" + (" then the error in-band" if in_band else "")
    finally:
        connection.close()


def nan_setting(python: str, checkout: Path) -> str:
    done = subprocess.run([python, "-m", "omlx_core", "config", "show", "--set",
                           "memory.queue_timeout_s=nan"], capture_output=True, text=True,
                          timeout=120, env=preload_env(), cwd=checkout)
    return "accepted" if done.returncode == 0 else "refused (exit 2)"


def distributed_source(checkout: Path) -> dict[str, str]:
    plugin = checkout / "plugins" / "distributed"
    source = "".join(p.read_text() for p in plugin.glob("*.py"))
    return {"step messages unpickled (pickle.loads in plugins/distributed)":
            str("pickle.loads" in source),
            "tokenizer loaded with trust_remote_code=True": str('"trust_remote_code": True' in source)}


def distributed_group(python: str, checkout: Path, cache_root: Path, tier_args: list[str]) -> str:
    """``mlx.launch -n 3 --backend ring -- omlx-core serve --distributed tensor`` answering
    a 40-token chat, or how it died."""
    port = free_port()
    launcher = str(Path(python).with_name("mlx.launch"))
    log_path = Path(tempfile.mkstemp(prefix="omlx-attacks-dist-", suffix=".log")[1])
    env = preload_env() | {"OMLX_CACHE_DIR": str(cache_root)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([launcher, "-n", "3", "--backend", "ring", "--", python, "-m",
                                    "omlx_core", "serve", "--distributed", "tensor",
                                    "--port", str(port), *tier_args],
                                   stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=checkout, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while f":{port}" not in log_path.read_text(errors="replace") or "ready" not in \
                log_path.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                return "did not start: " + log_path.read_text(errors="replace")[-200:]
            time.sleep(1)
        took, status, _ = timed(port, chat("Tell me a short story about a cat.", max_tokens=40),
                                timeout=1500)
        if status == 200:
            return f"answered 40 tokens in {took:.0f} s"
        died = [line for line in log_path.read_text(errors="replace").splitlines()
                if "group is dead" in line]
        return f"{status} after {took:.0f} s" + (f": {died[0][-120:]}" if died else "")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)


def distributed_groups(label: str, python: str, checkout: Path, cache_root: Path, run: Run) -> None:
    """Finding 5: the 3-rank group with and without ``--tier cluster``."""
    for name, tier_args in (("with --tier cluster", ["--tier", "cluster"]), ("without --tier", [])):
        print(f"[{label}] 3 ranks {name}", flush=True)
        run.findings[f"3 ranks, default model, {os.cpu_count()} cores, {name}: a 40-token chat"] = \
            distributed_group(python, checkout, cache_root, tier_args)


# -- running it ----------------------------------------------------------------------------------


@dataclass
class Run:
    flood: FloodResult | None = None
    #: with ``--control``: each round's flood (the first is ``flood``) and its control
    floods: list[FloodResult] = field(default_factory=list)
    controls: list[FloodResult] = field(default_factory=list)
    findings: dict[str, str] = field(default_factory=dict)


def flood_and_controls(label: str, python: str, checkout: Path, args: argparse.Namespace,
                       run: Run) -> None:
    """Round 1's control after the flood already run, then for each further round a
    flood and its control, each on a fresh server: the order alternates within a round
    only, so both see the same machine."""
    for round_ in range(args.rounds):
        if round_ > 0:
            run.floods.append(on_fresh_server(
                f"[{label}] round {round_ + 1}: grammar flood for {args.flood_s:.0f} s",
                python, checkout, lambda server: grammar_flood(server, args.flood_s)))
        turns = run.floods[-1].turns
        run.controls.append(on_fresh_server(
            f"[{label}] round {round_ + 1}: control, {turns} turns of the same chats, no flood",
            python, checkout, lambda server: grammar_flood(server, 0, control_turns=turns)))


def on_fresh_server(what: str, python: str, checkout: Path, measure) -> FloodResult:
    print(what, flush=True)
    cache_root = fresh_cache_root()
    try:
        server = Served(python, checkout, free_port(), cache_root, [])
        try:
            return measure(server)
        finally:
            server.close()
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


def run_checkout(label: str, python: str, checkout: Path, models: dict[str, Path],
                 args: argparse.Namespace) -> Run:
    run = Run()
    cache_root = fresh_cache_root()
    try:
        if args.distributed_only:
            distributed_groups(label, python, checkout, cache_root, run)
            return run
        print(f"[{label}] default server: grammar flood for {args.flood_s:.0f} s", flush=True)
        server = Served(python, checkout, free_port(), cache_root, [])
        try:
            run.flood = grammar_flood(server, args.flood_s)
            run.floods.append(run.flood)
            if args.flood_only:
                server.close()
                if args.control:
                    flood_and_controls(label, python, checkout, args, run)
                return run
            run.findings.update(csrf_and_rebinding(server))
            run.findings.update(smaller_holes(server, cache_root))
        finally:
            server.close()
        extra = [("--config", str(models["config"])),
                 ("--set", f"server.api_keys={KEY}"), ("--set", "server.stream_keepalive_s=0.05")]
        print(f"[{label}] server with an API key, a broken and a second model: "
              + " ".join(f"{flag} {value}" for flag, value in extra), flush=True)
        server = Served(python, checkout, free_port(), cache_root, [a for pair in extra for a in pair])
        try:
            run.findings.update(keyed_server_holes(server, models["broken"]))
            run.findings["stream for a model loading past the keep-alive, prompt over its "
                         "context"] = stream_after_load(server)
        finally:
            server.close()
        run.findings["memory.queue_timeout_s = nan"] = nan_setting(python, checkout)
        run.findings.update(distributed_source(checkout))
        if args.distributed:
            distributed_groups(label, python, checkout, cache_root, run)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    return run


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def flood_rows(results: dict[str, FloodResult]) -> list[tuple[str, ...]]:
    """One column per result; a control's column has no flood requests to show."""
    def each(make) -> tuple[str, ...]:
        return tuple(make(result) for result in results.values())

    def flooded(make) -> tuple[str, ...]:
        return each(lambda f: make(f) if f.flooded else "-")

    return [
        ("turns of the three chats", *each(lambda f: str(f.turns))),
        ("plain chat idle, median s", *each(lambda f: f"{median(f.idle_chat_s):.2f}")),
        ("plain chat under the flood, median s (ratio to idle)", *each(
            lambda f: f"{median(f.flood_chat_s):.2f} ({median(f.flood_chat_s) / median(f.idle_chat_s):.2f}x)")),
        ("plain chat under the flood, worst s", *each(lambda f: f"{max(f.flood_chat_s):.2f}")),
        ("new json_schema chat: 200s / sent; median, worst s", *each(
            lambda f: f"{f.schema_ok}/{len(f.schema_s)}; {median(f.schema_s):.2f}, {max(f.schema_s):.2f}")),
        ("tool-call chat: 200s / sent; median, worst s", *each(
            lambda f: f"{f.tool_ok}/{len(f.tool_s)}; {median(f.tool_s):.2f}, {max(f.tool_s):.2f}")),
        ("flood requests: statuses; naming a grammar.* cap; median s", *flooded(
            lambda f: f"{dict(sorted(f.flood_statuses.items()))}; {f.flood_named_cap}/"
                      f"{sum(f.flood_statuses.values())}; {median(f.flood_s):.2f}")),
        ("resident memory, server and children: before the flood, MiB", *each(
            lambda f: f"{f.rss_before / MIB:.0f}")),
        ("  growth at its largest / after, MiB", *each(
            lambda f: f"+{(f.rss_peak - f.rss_before) / MIB:.0f} / +{f.growth_after() / MIB:.0f}")),
        ("  of it the prefix cache's growth (the chats' KV, reclaimable), MiB", *each(
            lambda f: f"+{(f.prefix_after - f.prefix_before) / MIB:.0f}")),
        ("  of it the grammar compile workers' growth (idle: reclaimable), MiB", *each(
            lambda f: f"{(f.workers_after - f.workers_before) / MIB:+.0f}")),
        ("  growth after, outside the prefix cache, MiB", *each(
            lambda f: f"+{(f.growth_after() - (f.prefix_after - f.prefix_before)) / MIB:.0f}")),
    ]


def flood_against_control(run: Run) -> tuple[str, str]:
    """The flood's own growth, each round's flooded server less its control, and the
    summary line (median over rounds, with the range)."""
    columns: dict[str, FloodResult] = {}
    own = []
    for round_, (flood, control) in enumerate(zip(run.floods, run.controls), 1):
        columns[f"flood {round_}"], columns[f"control {round_}"] = flood, control
        own.append((flood.growth_after() - control.growth_after(),
                    flood.rss_peak - flood.rss_before - (control.rss_peak - control.rss_before)))
    after, peak = ([pair[i] / MIB for pair in own] for i in (0, 1))
    summary = (f"The flood's own resident growth (flooded less control, {len(own)} rounds): "
               f"after **{median(after):+.0f} MiB** ({min(after):+.0f} to {max(after):+.0f}), "
               f"at its largest {median(peak):+.0f} MiB ({min(peak):+.0f} to {max(peak):+.0f}).")
    return table(flood_rows(columns), list(columns)), summary


def table(rows: list[tuple[str, ...]], labels: list[str]) -> str:
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def prepare_models(workdir: Path) -> dict[str, Path]:
    """A configuration with a model whose directory is gone (its load error names a
    path) and a second, tiny model loaded on demand with a 4096-token context."""
    broken = workdir / "models" / "broken-model"
    second = cached_model("llama", 0, cache_dir=workdir / "tiny")
    config = workdir / "attacks.toml"
    config.write_text(f'[models.broken]\npath = "{broken}"\n\n[models.second]\npath = "{second}"\n')
    return {"broken": broken, "second": second, "config": config}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=None,
                        help="a checkout of the commit before, with its own .venv (without "
                             "it, only this checkout is replayed)")
    parser.add_argument("--flood-only", action="store_true",
                        help="replay only the grammar flood (one server per checkout)")
    parser.add_argument("--flood-s", type=float, default=120.0,
                        help="seconds the grammar flood lasts (default 120)")
    parser.add_argument("--control", action="store_true",
                        help="with --flood-only: after each flood, the same chats on a fresh "
                             "server without it (the flood's own memory is the difference)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --control: flood and control pairs (default 1)")
    parser.add_argument("--distributed", action="store_true",
                        help="also start 3-rank groups with mlx.launch (several minutes each)")
    parser.add_argument("--distributed-only", action="store_true",
                        help="replay only the 3-rank groups of --distributed")
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args(argv)
    if args.control and not args.flood_only:
        parser.error("--control goes with --flood-only")
    if args.distributed_only and (args.flood_only or args.control):
        parser.error("--distributed-only replays no flood")
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    before_python = args.before / ".venv" / "bin" / "python" if args.before else None
    if before_python is not None and not before_python.exists():
        raise SystemExit(f"{args.before} has no .venv/bin/python: run ./setup.sh test --co -q there")
    ensure_default_model(progress=False)
    workdir = Path(tempfile.mkdtemp(prefix="omlx-attacks-"))
    try:
        models = prepare_models(workdir)
        here = Path(__file__).resolve().parent.parent
        runs = {}
        if before_python is not None:
            runs[BEFORE] = run_checkout(BEFORE, str(before_python), args.before, models, args)
        runs[AFTER] = run_checkout(AFTER, sys.executable, here, models, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    labels = list(runs)
    findings = [(name, *(run.findings.get(name, "-") for run in runs.values()))
                for name in runs[AFTER].findings]
    load = os.getloadavg()
    report = "\n\n".join([
        f"# Attacks replayed, before and after ({datetime.date.today()})",
        f"{platform.machine()}, {os.cpu_count()} cores, load average {load[0]:.2f} at the end; "
        f"servers: `omlx-core serve` (default model, the tier the machine picks)"
        + ("" if args.distributed_only else
           f"; flood {args.flood_s:.0f} s of 3 clients' 60,000-value enums"),
        *([] if args.distributed_only else [
            "## Grammar flood",
            table(flood_rows({label: run.flood for label, run in runs.items()}), labels)]),
        *(section for label, run in runs.items() if run.controls
          for section in (f"## Grammar flood against a control ({label})",
                          *flood_against_control(run))),
        *(["## The other findings", table(findings, labels)] if findings else []),
    ])
    publish_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
