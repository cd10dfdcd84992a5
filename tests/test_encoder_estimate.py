"""The peak of an encode forward (embeddings, scores): the estimate against
``mx.get_peak_memory()`` of real forwards, and the guard's stages asking for it: the
forward gate sums the rows of a padded batch and keeps nothing held after it."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from omlx_core.encoding import EncodeInput
from omlx_core.memory.forward_gate import PrefillForwardGate
from omlx_core.memory.gate import PrefillChunk, PrefillStep
from omlx_core.memory.types import CeilingBreakdown, LimitSnapshot, PeakQuery
from omlx_core.memory.usage import MemoryUsage
from omlx_core.plugins.encoder.backbone import PaddedBatch, normalized, pool
from omlx_core.plugins.encoder.bert import BertConfig, BertModel
from omlx_core.plugins.estimator import estimate_peak
from omlx_core.testing import family_config

MIB = 1 << 20
#: the estimate may overcount by this much (measured 1.10-1.46 over these shapes and
#: others)
MAX_RATIO = 1.5
#: below 1 MiB measured a ratio says nothing: the peak of a 1 x 16 forward is set by how
#: far dispatch ran ahead of mlx's CPU worker (minilm-like: 0.46 MiB over 20 runs alone,
#: 0.19 MiB once in CI beside a second test process, ratio 3.49), so there the bound is
#: on the bytes overcounted, which no ceiling of a serving machine notices
SMALL_PEAK = 1 * MIB
MAX_OVERCOUNT_SMALL = 1 * MIB

CONFIGS = {
    "minilm-like": dict(hidden_size=384, intermediate_size=1536, num_attention_heads=12,
                        num_hidden_layers=2),
    "wide-mlp": dict(hidden_size=256, intermediate_size=2048, num_attention_heads=4,
                     num_hidden_layers=2),
    "many-heads": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=32,
                       num_hidden_layers=3),
}
SHAPES = [(1, 16), (1, 256), (32, 16), (128, 16), (8, 128), (4, 512)]


def bert_config(dims: dict[str, int]) -> dict[str, object]:
    return {"model_type": "bert", "vocab_size": 500, "max_position_embeddings": 512,
            "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
            "pad_token_id": 0, **dims}


#: runs of a forward its peak is the largest of: on mlx's CPU stream, buffers are
#: allocated when an operation is dispatched and freed when the worker has run the ones
#: reading them, so one forward's peak depends on how far dispatch ran ahead (the tiny
#: llama's 1 x 64 forward: 324-389 KiB over 30 runs, and 120 KiB once in a full suite
#: run, 4.3x under its estimate); the estimate bounds the largest
PEAK_RUNS = 3


def measured_peak(run) -> int:  # type: ignore[no-untyped-def]
    peaks = []
    for _ in range(PEAK_RUNS):
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        run()
        mx.synchronize()
        peaks.append(mx.get_peak_memory() - base)
    return max(peaks)


@pytest.fixture(autouse=True)
def no_buffer_cache():
    previous = mx.set_cache_limit(0)
    yield
    mx.set_cache_limit(previous)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_bert_forward_never_exceeds_its_estimate(name: str) -> None:
    config = bert_config(CONFIGS[name])
    model = BertModel(BertConfig.from_dict(config))
    mx.eval(model.parameters())
    for rows, width in SHAPES:
        batch = PaddedBatch.of([EncodeInput(tuple([5] * width))] * rows, 0)
        ids, lengths = mx.array(batch.ids), mx.array(batch.lengths)
        mx.eval(ids, lengths)

        def forward() -> None:
            mx.eval(normalized(pool(model(ids, lengths), lengths, "mean")))

        peak = measured_peak(forward)
        estimate = estimate_peak(PeakQuery(model_config=config, new_tokens=width, rows=rows,
                                           encode=True))
        ratio = estimate.total / peak
        detail = f"{name} {rows}x{width}: measured {peak / MIB:.2f} MiB, ratio {ratio:.2f}"
        assert ratio >= 1.0, detail
        if peak >= SMALL_PEAK:
            assert ratio <= MAX_RATIO, detail
        else:
            assert estimate.total - peak <= MAX_OVERCOUNT_SMALL, detail
        assert estimate.kv_bytes == 0 and estimate.held_bytes == 0 and estimate.kv_bytes_per_token == 0


def test_a_decoder_forward_for_its_hidden_states_never_exceeds_its_estimate(tmp_path) -> None:
    from omlx_core.models.loader import load_model
    from omlx_core.testing import build_model

    model, _tokenizer = load_model(build_model("llama", tmp_path / "llama"))
    config = family_config("llama")
    for rows, width in [(1, 64), (8, 64), (4, 256), (16, 32)]:
        ids = mx.array(np.full((rows, width), 7, dtype=np.int32))
        mx.eval(ids)
        peak = measured_peak(lambda: mx.eval(model.model(ids)[:, -1]))
        estimate = estimate_peak(PeakQuery(model_config=config, new_tokens=width, rows=rows,
                                           encode=True))
        detail = f"llama {rows}x{width}: measured {peak / MIB:.2f} MiB, estimate {estimate}"
        assert estimate.total >= peak, detail
        if peak >= SMALL_PEAK:
            assert estimate.total <= 3.0 * peak, detail
        else:
            assert estimate.total - peak <= MAX_OVERCOUNT_SMALL, detail


def test_the_forward_gate_judges_an_encode_batch_as_the_sum_of_its_rows() -> None:
    config = bert_config(CONFIGS["minilm-like"])
    one_row = estimate_peak(PeakQuery(model_config=config, new_tokens=128, rows=1,
                                      encode=True)).total
    usage = MemoryUsage(read_active=lambda: 100 * MIB, read_footprint=lambda: 0)
    gate = PrefillForwardGate(estimate_peak, usage, 0)

    def step(rows: int, hard: int) -> PrefillStep:
        return PrefillStep(model_id="bert", chunks=tuple(
            PrefillChunk(f"r{i % 2}", 128, 0, 100, forward=0 if rows > 1 else None)
            for i in range(rows)), decoding=0, chunk_size=128 * rows,
            limits=LimitSnapshot(hard_bytes=hard, breakdown=CeilingBreakdown(custom=hard)),
            model_config=config, encode=True, running=2)

    hard = 100 * MIB + 8 * one_row + MIB
    assert gate.check_prefill(step(8, hard)) == {}
    assert set(gate.check_prefill(step(9, hard))) == {"r0", "r1"}
    assert gate.refused_total == 0  # a shared forward's refusal is provisional
