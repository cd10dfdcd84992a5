"""A decode lane copies its KV one layer at a time: what mlx holds while rows join, the
batch cache grows and rows leave is the lane's KV plus one layer's copy, never the KV
twice (the KV benchmark's full-precision server went 0.2 GiB over its 1.5 GiB ceiling
when its last three 4k-token rows retired together: every layer's batch stayed alive
until all the rows had been copied out).

Measured with mlx's peak counter (it tracks every allocation on the CPU backend) on a
tiny model whose rows are long enough for a layer's KV to dwarf a step's activations.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import pytest
from mlx_lm.generate import generation_stream

from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.loader import load_model
from omlx_core.scheduling.batch_state import new_sequence
from omlx_core.scheduling.decode_batch import Lane
from omlx_core.scheduling.kv_cache import KVFormat, make_request_cache
from omlx_core.scheduling.sampling import BatchSampling
from omlx_core.testing.models import build_model

#: 64-wide heads (8-bit KV quantizes in groups of 64), 4 layers
OVERRIDES = {"head_dim": 64}
#: each row's prompt: the rows differ in length, so joins pad and leaves cut columns
LENGTHS = (700, 610, 520)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("lane-memory"), overrides=OVERRIDES)


def _layer_bytes(lane: Lane) -> int:
    return max(int(layer.nbytes) for layer in lane.cache or ())


def _over(operation: Callable[[], Any]) -> tuple[int, int, int]:
    """``(before, peak, after)``: mlx's active bytes around ``operation`` and its peak."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    operation()
    mx.synchronize()
    return before, mx.get_peak_memory(), mx.get_active_memory()


def _row_cache(model: Any, kv_format: KVFormat, length: int) -> tuple[Any, list[Any], int]:
    prompt = [(7 * i) % 200 + 3 for i in range(length)]
    sequence = new_sequence(GenerationRequest(f"row-{length}", prompt,
                                              SamplingParams(temperature=0.0, max_tokens=400)))
    cache = make_request_cache(model, kv_format)
    mx.eval([layer.state for layer in cache], model(mx.array(prompt[:-1])[None], cache=cache))
    logits = model(mx.array(prompt[-1:])[None], cache=cache)[:, -1, :]
    return sequence, cache, int(mx.argmax(logits, axis=-1).item())


@pytest.mark.parametrize("bits", [0, 8])
def test_joins_growth_and_retirement_hold_one_layer_twice_at_most(model_path, bits):
    """The batch cache's growth before a step and every row leaving at once peak at most
    one layer's KV over what mlx holds before or after, a join two (mlx-lm's ``extend``
    pads both batches, then concatenates them); after the lane grew its cache, the
    step's forward grows no layer (it would copy them all in one graph)."""

    def run() -> dict[str, tuple[int, int, int, int]]:
        model, _ = load_model(model_path)
        kv_format = KVFormat.from_settings(bits, 64)
        seen: dict[str, tuple[int, int, int, int]] = {}
        with mx.stream(generation_stream):
            lane, sampling = Lane(), BatchSampling()
            for length in LENGTHS:
                sequence, cache, token = _row_cache(model, kv_format, length)
                seen[f"join {length}"] = (*_over(lambda: lane.add(sequence, token, cache)),
                                          _layer_bytes(lane))
                del cache
            # Merged rows fill their buffers exactly: the first step must grow them all.
            before = _layer_bytes(lane)
            seen["growth"] = (*_over(lambda: lane.reserve(1)), before)
            capacities = [layer.state[0].shape[2] if bits == 0 else layer.state[0][0].shape[2]
                          for layer in lane.cache]
            for _ in range(3):
                lane.reserve(1)
                lane.plain_step(model, sampling)
            mx.eval(lane.fed)
            after = [layer.state[0].shape[2] if bits == 0 else layer.state[0][0].shape[2]
                     for layer in lane.cache]
            assert after == capacities, "the forward grew the batch cache itself"
            layer = _layer_bytes(lane)
            seen["every row leaves"] = (*_over(lambda: lane.take_out(list(range(len(LENGTHS))))),
                                        layer)
        return seen

    seen = mlx_thread().run(run)
    for what, (before, peak, after, layer) in seen.items():
        over = peak - max(before, after)
        layers = 2 if what.startswith("join") else 1
        # 64 KiB: the small arrays beside the KV (offsets, masks, the fed tokens)
        assert over <= layers * layer + (64 << 10), (
            f"{what}: peaked {over} bytes over what mlx held before or after it, more than "
            f"{layers} layer(s) of KV ({layer} bytes each): layers were copied together")
