"""The step messages between ranks: typed, versioned JSON that round-trips what the engine
uses, and a decoder that refuses anything else (pickle above all) so that a rank fed
hostile bytes exits cleanly, its requests ending with an error."""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path

import pytest

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.grammar import GrammarSpec
from omlx_core.memory.gate import DecodePlan
from omlx_core.memory.types import CeilingBreakdown, Rejection, RequestRejected
from omlx_core.plugins.distributed import wire
from omlx_core.plugins.distributed.cluster import EXIT_GROUP_DEAD, Cluster, GroupDead
from omlx_core.plugins.distributed.liveness import Heartbeats
from omlx_core.plugins.distributed.step_sync import CollectiveSteps
from omlx_core.testing.waiting import wait_for, wait_for_output


def request(rid: str = "req-1", **sampling) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3, 50_000], SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=2**63 - 1, max_tokens=32,
        stop_token_ids=(2,), repetition_penalty=1.1, logit_bias={5: -100.0, 7: 2.5}, logprobs=3,
        grammar=GrammarSpec.json_schema({"type": "object", "properties": {"a": {"enum": [1, 2]}}}),
        **sampling), cache_salt="tenant-a", cache_points=(2,))


def test_a_step_round_trips_what_the_engine_uses() -> None:
    arrivals = [(request("req-1"), 12345), (GenerationRequest("req-2", [9], SamplingParams()), 0)]
    step = wire.decode_step(wire.encode_step(arrivals, ["req-0"]))
    assert not step.stop and step.aborts == ("req-0",)
    (first, seed), (second, _) = step.arrivals
    assert seed == 12345 and first == arrivals[0][0] and second == arrivals[1][0]
    assert first.sampling.grammar.key == arrivals[0][0].sampling.grammar.key
    assert wire.decode_step(wire.encode_stop()).stop


def test_the_gates_answers_round_trip() -> None:
    breakdown = CeilingBreakdown(static=10, dynamic=8, custom=6, tier="custom", notes=("x",),
                                 elsewhere="on rank 1 of 2", rank=1, ranks=2)
    refused = RequestRejected(Rejection(estimated_bytes=7, limit_bytes=6, breakdown=breakdown,
                                        request_id="r", model_id="m", prompt_tokens=3,
                                        stage="forward", cause="memory_short", detail="d",
                                        pinned_models=("p",)), ["raise it"], 2.5, wait=True)
    (rid, back), = wire.decode_refusals(wire.encode_refusals({"r": refused})).items()
    assert rid == "r" and back.rejection == refused.rejection
    assert (back.advice, back.retry_after_s, back.wait) == (["raise it"], 2.5, True)
    plan = DecodePlan({"a": 512, "b": 1 << 62}, ("c",))
    assert wire.decode_plan(wire.encode_plan(plan)) == plan
    assert wire.decode_flag(wire.encode_flag(True)) is True
    assert wire.decode_count(wire.encode_count(123)) == 123
    hello = wire.Hello("127.0.0.1", 4242, "ab" * 16)
    assert wire.decode_hello(wire.encode_hello(hello)) == hello


class Explodes:
    """What an attacker would pickle: unpickling it writes a file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "owned"))


def valid() -> dict:
    return json.loads(wire.encode_step([(request(), 1)], []))


def mutated(change) -> bytes:
    message = valid()
    change(message)
    return json.dumps(message).encode()


def hostile(tmp_path: Path) -> dict[str, bytes]:
    return {
        "pickle": pickle.dumps({"arrivals": [], "aborts": [], "x": Explodes(tmp_path / "owned")}),
        "empty": b"",
        "not utf-8": b"\xff\xfe\x00{",
        "not json": b"{\"v\": 1, \"kind\": ",
        "a list": b"[1, 2, 3]",
        "another version": mutated(lambda m: m.update(v=wire.WIRE_VERSION + 1)),
        "another kind": mutated(lambda m: m.update(kind="exec")),
        "an unknown field": mutated(lambda m: m["body"].update(run="rm -rf /")),
        "a missing field": mutated(lambda m: m["body"].pop("aborts")),
        "a token as text": mutated(lambda m: m["body"]["arrivals"][0]["prompt_tokens"].append("7")),
        "a negative token": mutated(lambda m: m["body"]["arrivals"][0]["prompt_tokens"].append(-1)),
        "a huge token": mutated(lambda m: m["body"]["arrivals"][0]["prompt_tokens"].append(2**40)),
        "a bool for an int": mutated(lambda m: m["body"]["arrivals"][0].update(seed=True)),
        "no prompt": mutated(lambda m: m["body"]["arrivals"][0].update(prompt_tokens=[])),
        "a cache point past the prompt": mutated(lambda m: m["body"]["arrivals"][0].update(cache_points=[4])),
        "NaN": wire.encode_step([(request(), 1)], []).replace(b'"temperature":0.7',
                                                             b'"temperature":NaN'),
        "a grammar over the caps": mutated(lambda m: m["body"]["arrivals"][0]["sampling"]["grammar"]
                                           .update(text=json.dumps({"enum": list(range(5000))}))),
        "an unknown grammar kind": mutated(lambda m: m["body"]["arrivals"][0]["sampling"]["grammar"]
                                           .update(kind="python")),
        "deep nesting": b'{"v":1,"kind":"step","body":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "over the size limit": b" " * (wire.MAX_MESSAGE_BYTES + 1),
    }


def test_hostile_bytes_are_refused_and_nothing_in_them_runs(tmp_path) -> None:
    for name, data in hostile(tmp_path).items():
        with pytest.raises(wire.WireError):
            wire.decode_step(data)
        assert not (tmp_path / "owned").exists(), name
    with pytest.raises(wire.WireError, match=f"version {wire.WIRE_VERSION + 1}"):
        wire.decode_step(mutated(lambda m: m.update(v=wire.WIRE_VERSION + 1)))
    with pytest.raises(wire.WireError, match="refusals"):
        wire.decode_refusals(wire.encode_step([], []))  # a step where refusals were due


# -- a follower fed hostile bytes -----------------------------------------------------------------


class Group:
    """Rank 1 of 2, for a Cluster whose collectives the test plays."""

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


class PlayedCluster(Cluster):
    """Rank 1 whose broadcasts deliver what the test scripted (as a ring peer could),
    and whose exit is recorded instead of ending the test process."""

    def __init__(self, messages: list[bytes]) -> None:
        self.exits: list[int] = []
        super().__init__(Group(), heartbeat_s=0.2, liveness_timeout_s=30, exit_after_s=0,
                         exit=self.exits.append)
        self._messages = messages

    def broadcast(self, data: bytes | None) -> bytes:
        return self._messages.pop(0)


def test_a_follower_fed_hostile_bytes_declares_the_group_dead_and_exits_cleanly(tmp_path) -> None:
    # A real rank 0's heartbeat listener: the follower joins it as in a group.
    leader = Heartbeats(0, 2, interval_s=0.2, timeout_s=30, exit_after_s=0,
                        on_dead=lambda reason: None, steps=lambda: 0)
    hello = leader.listen("127.0.0.1")
    cluster = PlayedCluster([wire.encode_hello(hello), hostile(tmp_path)["pickle"]])
    ended: list[str] = []
    cluster.on_death(ended.append)  # the engine ends its in-flight requests here
    steps = CollectiveSteps(cluster, heartbeat_s=0.2, make_sequence=lambda r, s: None,
                            on_stop=lambda: [])
    try:
        with pytest.raises(GroupDead):
            steps.exchange([], [])
        assert not (tmp_path / "owned").exists()
        assert cluster.dead is not None and "cannot read" in cluster.dead
        assert ended == [cluster.dead]
        assert wait_for(lambda: cluster.exits == [EXIT_GROUP_DEAD])
        with pytest.raises(GroupDead):  # and it takes no further step
            steps.exchange([], [])
    finally:
        cluster.close()
        leader.close()


def test_a_follower_whose_first_message_is_not_rank_0s_hello_exits(tmp_path) -> None:
    cluster = PlayedCluster([hostile(tmp_path)["another kind"]])
    steps = CollectiveSteps(cluster, heartbeat_s=0.2, make_sequence=lambda r, s: None,
                            on_stop=lambda: [])
    try:
        with pytest.raises(GroupDead):
            steps.exchange([], [])
        assert "cannot join rank 0's heartbeats" in cluster.dead
        assert wait_for(lambda: cluster.exits == [EXIT_GROUP_DEAD])
    finally:
        cluster.close()


def test_a_heartbeat_connection_without_the_token_is_refused() -> None:
    import socket

    deaths: list[str] = []
    leader = Heartbeats(0, 2, interval_s=0.1, timeout_s=30, exit_after_s=0,
                        on_dead=deaths.append, steps=lambda: 0)
    hello = leader.listen("127.0.0.1")
    try:
        intruder = socket.create_connection((hello.address, hello.port))
        intruder.sendall(b"\x00" * 16 + b"\x00\x01")  # a wrong token for rank 1
        assert wait_for(lambda: intruder.recv(1) == b"")  # closed on it
        intruder.close()
        follower = Heartbeats(1, 2, interval_s=0.1, timeout_s=30, exit_after_s=0,
                              on_dead=deaths.append, steps=lambda: 0)
        follower.connect(hello)
        # The follower was let in: rank 0 reads its beats.
        assert wait_for(lambda: leader.beats_received(1) >= 1)
        follower.close()
    finally:
        leader.close()


def test_a_rank_that_stops_on_purpose_is_not_taken_for_dead() -> None:
    # Rank 0 shuts the group down: it broadcasts the stop, then closes its heartbeats.
    # A follower may hear the connection close before it reads the stop (three ranks on
    # two cores did): it must not exit as if rank 0 had died.
    leader_deaths: list[str] = []
    follower_deaths: list[str] = []
    leader = Heartbeats(0, 2, interval_s=0.05, timeout_s=30, exit_after_s=0,
                        on_dead=leader_deaths.append, steps=lambda: 0)
    follower = Heartbeats(1, 2, interval_s=0.05, timeout_s=30, exit_after_s=0,
                          on_dead=follower_deaths.append, steps=lambda: 0)
    try:
        follower.connect(leader.listen("127.0.0.1"))
        assert wait_for(lambda: leader.beats_received(1) >= 1 and follower.beats_received(0) >= 1)
        leader.close()
        assert wait_for(lambda: follower.has_left(0))
        # The follower's beats and liveness clock go on (five more beats): neither
        # makes the rank that left dead.
        sent = follower.beats_sent()
        assert wait_for(lambda: follower.beats_sent() >= sent + 5)
        assert follower_deaths == []
    finally:
        follower.close()
        leader.close()
    assert leader_deaths == []


def test_a_rank_that_closes_without_saying_it_leaves_is_dead() -> None:
    # A dead group's rank closes without the leaving record, as a killed one does.
    deaths: list[str] = []
    leader = Heartbeats(0, 2, interval_s=0.05, timeout_s=30, exit_after_s=0,
                        on_dead=deaths.append, steps=lambda: 0)
    follower = Heartbeats(1, 2, interval_s=0.05, timeout_s=30, exit_after_s=0,
                          on_dead=lambda reason: None, steps=lambda: 0)
    try:
        follower.connect(leader.listen("127.0.0.1"))
        assert wait_for(lambda: leader.beats_received(1) >= 1)
        follower.close(leaving=False)
        assert wait_for(lambda: deaths != [])
        assert "rank 1 closed its heartbeat connection" in deaths[0]
        assert not leader.has_left(1)
    finally:
        leader.close()


FOLLOWER = """
import sys, threading
from omlx_core.plugins.distributed.liveness import Heartbeats
from omlx_core.plugins.distributed.wire import decode_hello
hello = decode_hello(sys.stdin.buffer.read())
Heartbeats(1, 2, interval_s=0.05, timeout_s=30, exit_after_s=0, on_dead=print,
           steps=lambda: 0).connect(hello)
print("joined", flush=True)
threading.Event().wait()
"""


def test_the_group_is_alive_while_its_ranks_beat_however_long_a_step_takes(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    deaths: list[str] = []
    leader = Heartbeats(0, 2, interval_s=0.05, timeout_s=5.0, exit_after_s=0,
                        on_dead=deaths.append, steps=lambda: 0)
    hello = leader.listen("127.0.0.1")
    log = tmp_path / "follower.log"
    with log.open("wb") as output:
        follower = subprocess.Popen([sys.executable, "-c", FOLLOWER], stdin=subprocess.PIPE,
                                    stdout=output)
    try:
        follower.stdin.write(wire.encode_hello(hello))
        follower.stdin.close()
        wait_for_output(follower, log, "joined\n", timeout=60)
        # Two liveness timeouts' worth of beats pass (a step as long as it takes): nobody
        # is dead. (The timeout is 5 s: on two cores shared with other tests' servers a
        # follower process went unscheduled for 2 s.)
        assert wait_for(lambda: leader.beats_received(1) >= 2 * 100, timeout=60)
        assert deaths == []
        # A rank stopped (its every thread frozen) sends nothing: it is dead.
        follower.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: deaths != [], timeout=20)
        assert "rank 1 did not answer: no heartbeat" in deaths[0]
    finally:
        follower.send_signal(signal.SIGCONT)
        follower.kill()
        follower.wait(timeout=60)
        leader.close()
