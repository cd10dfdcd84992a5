"""The prefill peak-memory estimate: how many bytes a prefill adds on top of memory
already in use (weights and every other request), derived from a model's config alone.

The estimate mirrors what mlx-lm and mlx actually allocate, measured with
``mx.get_peak_memory()`` on real forwards (``python -m benchmarks.estimator``):

- **KV caches** grow in steps of :data:`KV_STEP` tokens and are never trimmed; a growth
  concatenates the old buffer with a zero block, so both exist while the new one is
  written. Sliding-window layers (``RotatingKVCache``) keep ``window - 1`` old tokens plus
  the chunk during prefill. Latent-attention caches (deepseek_v3 and kin) store
  ``kv_lora_rank + qk_rope_head_dim`` values per token in one head; other MLA families
  in mlx-lm cache the expanded per-head keys and values. Linear-attention layers
  (GatedDeltaNet) hold a fixed conv + recurrent state.
- **Attention scores**: on CPU (and CUDA prefill) ``mx.fast.scaled_dot_product_attention``
  falls back to plain ops and materializes ``heads x chunk x kv_len`` scores in the
  activation dtype plus a one-byte causal mask; ``where`` and ``softmax`` reuse the
  score buffer. Only a fused Metal kernel avoids it.
- **Lazy evaluation**: the engine evaluates only the cache state of a prefill chunk, so
  the last layer's attention and MLP and the logits never run; only the first sampled
  token's ``1 x vocab`` logits do (unless the engine asks for every prompt logit).
- **Run-ahead**: mlx's CPU eval allocates the outputs of up to ~50 queued ops before the
  worker thread computes them, so a chunk's transient is about one whole decoder layer's
  allocations at once, scores and MLP together (:data:`LAYER_MARGIN`).
- **Decode join**: after the prompt's last token is fed in a one-token forward of its
  own (the batched engine's first-token forward), mlx-lm's ``BatchGenerator`` copies the
  request's cache into a batch cache (exact length, then one more step).

Everything here is a pure function of numbers (the model's :class:`~.dims.ModelDims`);
:meth:`PeakBreakdown.as_estimate` turns the worst step into the
:class:`~omlx_core.memory.types.PeakEstimate` the ``estimate_peak`` hook answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from omlx_core.memory.types import KV_STEP, PeakEstimate
from omlx_core.plugins.estimator.dims import FULL, LINEAR, SLIDING, ModelDims, quantized_row_bytes

# mlx's CPU eval loop allocates the outputs of up to ~50 queued ops before the worker
# thread computes them (10 tasks of 10 dispatches, two dispatches an op), which is about
# one decoder layer: the transient of a chunk is one layer's allocations alive together,
# the attention scores included, whatever phase the worker is in. Measured on mlx 0.32
# CPU across dense, MoE, wide-MLP and many-head models: the layer model lands within 3%
# of the chunk's transient; this margin covers it and timing differences between machines.
LAYER_MARGIN = 1.06

# The GatedDeltaNet ops path (CPU, CUDA) loops over the chunk's tokens lazily; the
# evaluation order keeps every step's float32 recurrent state alive until the chunk's
# outputs are read, plus per-step vectors. Upper envelope fitted per token over 14
# head-count/dim combinations at chunks 64 and 256 (estimate/measured 1.00 to 1.23):
# 1.14 states + 6 (v_heads x v_dim) + 16 (k_heads x k_dim) float32 values, with this
# margin on top.
LINEAR_SCAN_STATES = 1.14
LINEAR_SCAN_MARGIN = 1.02

# Arrays every forward makes whatever its size (token ids, RoPE tables, masks' index
# vectors, sampler state): small, but what dominates a tiny model's short prefill.
FIXED_OVERHEAD_BYTES = 128 * 1024


# -- component formulas -----------------------------------------------------------------


def grown_capacity(offset: int, capacity: int, appended: int, step: int = KV_STEP) -> int:
    """A KVCache's buffer length after appending ``appended`` tokens at ``offset``.

    A growth keeps the old buffer only up to ``offset`` when that is not a whole step,
    then concatenates ``ceil(appended / step)`` steps; nothing is ever trimmed.
    """
    if offset + appended <= capacity:
        return capacity
    kept = offset if offset % step else capacity
    return kept + math.ceil(appended / step) * step


def rotating_length(length: int, window: int, appended: int) -> int:
    """A RotatingKVCache's buffer length after a multi-token (prefill) update."""
    return min(length, window - 1) + appended


#: Score matrices mlx's SDPA fallback holds at once when the attention has sinks
#: (gpt-oss): the scores, the scores with the sink column joined on, and the softmax of
#: those. Measured on the tiny gpt-oss model: a 2,048-token chunk peaked at 3.2 times
#: its one score matrix, where a sink-less model peaks at 1.1 times.
SINK_SCORE_COPIES = 3


def attention_scores_bytes(heads: int, query_tokens: int, key_tokens: int, dtype_bytes: int,
                           sinks: bool = False) -> int:
    """The materialized score matrix plus its one-byte causal mask (CPU SDPA fallback);
    with ``sinks``, the :data:`SINK_SCORE_COPIES` score matrices the fallback holds then.

    omlx-core's CPU attention route (:mod:`omlx_core.models.attention`) masks the scores
    in place and holds no mask, but whether a model takes it depends on what this
    process has loaded (the route is a module global of the model's family): the
    estimate counts the mask either way, so it is the same with the route or without
    it, and never below what either holds (``tests/test_memory_estimate_routes.py``)."""
    scores = heads * query_tokens * key_tokens * dtype_bytes * (SINK_SCORE_COPIES if sinks else 1)
    mask = query_tokens * key_tokens if query_tokens > 1 else 0
    return scores + mask


def dequantized_kv_bytes(dims: ModelDims, key_tokens: int, dtype_bytes: int) -> int:
    """One full attention layer's keys and values expanded from a quantized cache: on
    the CPU backend omlx-core's attention route dequantizes a layer's KV before using it
    (:mod:`omlx_core.models.attention`), one layer at a time."""
    return key_tokens * dims.num_kv_heads * (dims.head_dim + dims.v_head_dim) * dtype_bytes


def tiled_kv_copy_bytes(dims: ModelDims, key_tokens: int, new_tokens: int, dtype_bytes: int,
                        value_row: int) -> int:
    """What a 4-bit cache with keys per channel (``omlx_core/scheduling/kv_tiles.py``)
    holds besides :func:`dequantized_kv_bytes` while one layer attends: the expanded
    tiles' keys before they are joined to the window's (a second copy of the keys), the
    values' stored rows joined before they are expanded, and the new tokens' keys joined
    to the window (transposed and quantized before attention, then let go)."""
    keys = dims.num_kv_heads * dims.head_dim * dtype_bytes
    return key_tokens * (keys + dims.num_kv_heads * value_row) + new_tokens * keys


def latent_attention_bytes(dims: ModelDims, query_tokens: int, key_tokens: int, dtype_bytes: int) -> int:
    """deepseek_v3-style prefill: rope scores and the full scores both materialize, and
    the latent cache is expanded to per-head keys and values over the whole context."""
    assert dims.latent is not None
    latent = dims.latent
    scores = 2 * dims.num_heads * query_tokens * key_tokens * dtype_bytes + query_tokens * key_tokens
    expanded = dims.num_heads * key_tokens * (latent.qk_nope_head_dim + latent.v_head_dim) * dtype_bytes
    return scores + expanded


def attention_activation_bytes(dims: ModelDims, tokens: int, dtype_bytes: int) -> int:
    """An attention layer's per-token allocations besides the scores: input norm, o_proj
    (3 hidden), queries through RoPE, scaling, attention output and its transposed copy
    (5 query), new keys and values (2 kv)."""
    query = dims.num_heads * dims.head_dim
    if dims.latent is not None:
        kv = 2 * (dims.latent.kv_lora_rank + dims.latent.qk_rope_head_dim)
    else:
        kv = dims.num_kv_heads * (dims.head_dim + dims.v_head_dim)
    return tokens * (3 * dims.hidden_size + 5 * query + 2 * kv) * dtype_bytes


def mlp_bytes(dims: ModelDims, tokens: int, dtype_bytes: int) -> int:
    """A dense MLP layer's allocations: norm and down projection (3 hidden), gate and up
    (the compiled SwiGLU writes into the gate's buffer)."""
    return tokens * (3 * dims.hidden_size + 2 * dims.intermediate_size) * dtype_bytes


def moe_bytes(dims: ModelDims, tokens: int, dtype_bytes: int) -> int:
    """An MoE layer's allocations: norm and output (3 hidden), router scores, each token's
    top-k copies of its hidden state sorted by expert, the experts' gate/up and down
    outputs (the unsort reuses the sorted copy's place in time), and a shared expert."""
    if dims.moe is None:
        return 0
    moe = dims.moe
    routed = moe.experts_per_token * (2 * dims.hidden_size + 2 * moe.intermediate_size)
    shared = (2 * moe.shared_intermediate_size + dims.hidden_size) if moe.shared_intermediate_size else 0
    return tokens * (3 * dims.hidden_size + routed + 2 * moe.num_experts + shared) * dtype_bytes


def linear_scan_bytes(dims: ModelDims, tokens: int, dtype_bytes: int, backend: str = "cpu") -> int:
    """One GatedDeltaNet layer's chunk on mlx-lm's ops path (CPU, CUDA): every step's
    float32 recurrent state stays alive until the chunk's outputs are read. Metal runs a
    kernel that keeps one state."""
    if dims.linear is None:
        return 0
    lin = dims.linear
    state = lin.num_value_heads * lin.value_head_dim * lin.key_head_dim * 4
    if backend == "metal" and lin.key_head_dim % 32 == 0:
        return 2 * state + 4 * tokens * lin.conv_dim * dtype_bytes
    per_token = (LINEAR_SCAN_STATES * state
                 + 4 * (6 * lin.num_value_heads * lin.value_head_dim
                        + 16 * lin.num_key_heads * lin.key_head_dim))
    return math.ceil(LINEAR_SCAN_MARGIN * tokens * per_token)


def logits_bytes(dims: ModelDims, tokens: int, dtype_bytes: int) -> int:
    """Logits of ``tokens`` positions, plus the float32 log-softmax the sampler reads."""
    return tokens * dims.vocab_size * (dtype_bytes + 4)


# -- the estimate -------------------------------------------------------------------------


#: the components that are cache the prefill leaves held (the rest is freed after its step)
CACHE_COMPONENTS = ("kv_cache", "window_cache", "recurrent_state", "kv_tile_window")


@dataclass(frozen=True)
class PeakBreakdown:
    """An estimated peak: the total and the named parts it is made of, at the step of the
    prefill where the peak falls."""

    total: int
    components: Mapping[str, int]
    step: str = ""
    dims: ModelDims | None = field(default=None, compare=False, repr=False)
    #: of ``total``, the cache the prefill leaves held once it is over (the most any of
    #: its paths leaves: after the decode join when there is one)
    kv_bytes: int = 0
    #: of ``total``, what the request holds beside the model's cache (image features)
    extra_bytes: int = 0
    #: cache bytes one more token holds, over every layer whose cache grows with it
    kv_bytes_per_token: int = 0

    def as_estimate(self) -> PeakEstimate:
        """The structured answer of the ``estimate_peak`` hook: the same total, split into
        what is freed after the worst step, the cache held, and the extra bytes."""
        return PeakEstimate(
            transient_bytes=self.total - self.kv_bytes - self.extra_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token, extra_bytes=self.extra_bytes,
            kv_bytes=self.kv_bytes)

    @property
    def dominant(self) -> str:
        """Name of the largest component."""
        return max(self.components, key=lambda name: self.components[name]) if self.components else ""

    def describe(self) -> str:
        """One line, largest part first: ``"812.0 MiB at chunk 4/4: attention_scores 600.0 MiB, ..."``."""
        parts = sorted(((v, k) for k, v in self.components.items() if v), reverse=True)
        listed = ", ".join(f"{name} {_mib(value)}" for value, name in parts)
        return f"{_mib(self.total)}{' at ' + self.step if self.step else ''}: {listed}"


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


@dataclass
class _CacheState:
    """Per-kind cache lengths in tokens while the prefill is simulated."""

    offset: int
    full_capacity: int
    window_length: int


def estimate_prefill_peak(dims: ModelDims, new_tokens: int, cached_tokens: int = 0,
                          chunk_size: int = 512, *, dtype_bytes: int = 4,
                          kv_bits: int | None = None, kv_group_size: int = 64,
                          full_logits: bool = False, first_token: bool = True,
                          cached_kv_resident: bool = True, backend: str = "cpu") -> PeakBreakdown:
    """Peak bytes a prefill adds on top of memory already in use.

    :param dims: the model (:meth:`ModelDims.from_config`).
    :param new_tokens: prompt tokens to run through the model.
    :param cached_tokens: tokens already in the cache being extended.
    :param chunk_size: tokens per forward (the engine's ``prefill_step_size``).
    :param dtype_bytes: bytes of the activation dtype (KV is cached in it too).
    :param kv_bits: quantized KV cache (mlx-lm ``QuantizedKVCache``) bits, or ``None``.
    :param kv_group_size: quantization group size of a quantized KV cache.
    :param full_logits: the engine evaluates every prompt position's logits.
    :param first_token: the last of ``new_tokens`` may instead be fed in a one-token
        forward, after which the cache joins mlx-lm's ``BatchGenerator`` (which copies
        it): the estimate covers both that and prefilling all ``new_tokens``.
    :param cached_kv_resident: whether the cached tokens' KV is already in memory inside
        the cache being extended; ``False`` when a reused prefix is copied into a fresh
        cache by the forward (its whole KV then counts as new).
    :param backend: ``"cpu"`` (measured), ``"cuda"`` or ``"metal"`` (fused attention
        and the GatedDeltaNet kernel are assumed there; not measured here).
    :returns: the :class:`PeakBreakdown` of the worst step.
    """
    check_counts(new_tokens=new_tokens, cached_tokens=cached_tokens, chunk_size=chunk_size,
                 dtype_bytes=dtype_bytes)
    if backend not in ("cpu", "cuda", "metal"):
        raise ValueError(f"backend must be 'cpu', 'cuda' or 'metal', not {backend!r}")
    settings = _Settings(dims, dtype_bytes, kv_bits, kv_group_size, full_logits, backend)
    if new_tokens == 0:
        return PeakBreakdown(0, {}, "nothing to prefill", dims,
                             kv_bytes_per_token=settings.growing_kv_row)
    candidates = [_simulate(settings, new_tokens, chunk_size, cached_tokens, cached_kv_resident,
                            join=False)]
    if first_token:
        candidates.append(_simulate(settings, new_tokens - 1, chunk_size, cached_tokens,
                                    cached_kv_resident, join=True))
    # Which path a prefill takes is the engine's choice: it leaves the most either leaves.
    return replace(max(candidates, key=lambda b: b.total),
                   kv_bytes=max(candidate.kv_bytes for candidate in candidates))


def check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, not {value!r}")
    if counts["chunk_size"] < 1 or counts["dtype_bytes"] < 1:
        raise ValueError("chunk_size and dtype_bytes must be at least 1")


@dataclass(frozen=True)
class _Settings:
    dims: ModelDims
    dtype_bytes: int
    kv_bits: int | None
    kv_group_size: int
    full_logits: bool
    backend: str

    @property
    def kv_row(self) -> int:
        """Bytes one token adds to one full attention layer (quantized with ``kv_bits``)."""
        return self.dims.kv_bytes_per_token(self.dtype_bytes, self.kv_bits, self.kv_group_size)

    @property
    def window_row(self) -> int:
        """Bytes one token adds to one sliding-window layer: mlx-lm has no quantized
        rotating cache, so those layers stay in the activation dtype whatever ``kv_bits``."""
        return self.dims.kv_bytes_per_token(self.dtype_bytes)

    @property
    def tiled(self) -> bool:
        """Whether keys are quantized per channel in tiles (4 bits), with a window of
        up to ``kv_group_size`` float keys per layer (``omlx_core/scheduling/kv_tiles.py``)."""
        return self.kv_bits == 4

    @property
    def value_row(self) -> int:
        """Bytes of one head's quantized value row."""
        return quantized_row_bytes(self.dims.v_head_dim, self.dtype_bytes, self.kv_bits, self.kv_group_size)

    @property
    def tile_window(self) -> int:
        """Bytes a tiled layer's window holds at most: ``kv_group_size`` tokens' float
        keys and quantized values."""
        if not self.tiled:
            return 0
        return self.kv_group_size * self.dims.num_kv_heads * (self.dims.head_dim * self.dtype_bytes + self.value_row)

    @property
    def growing_kv_row(self) -> int:
        """Bytes one more token adds over every full and sliding layer (a sliding layer
        stops growing at its window; counting it anyway never undercounts)."""
        return self.dims.count(FULL) * self.kv_row + self.dims.count(SLIDING) * self.window_row


def _simulate(s: _Settings, new_tokens: int, chunk_size: int, cached: int, resident: bool, *,
              join: bool) -> PeakBreakdown:
    dims = s.dims
    window = dims.sliding_window or 0
    state = _CacheState(offset=cached, full_capacity=cached,
                        window_length=min(cached, window - 1) if window else 0)
    # What the caches held before this prefill, if it is already counted as in use.
    start = _cache_bytes(s, state) if resident else {}
    full, rest = divmod(new_tokens, chunk_size)
    count = full + (1 if rest else 0)
    candidates: list[PeakBreakdown] = []

    # The resident cache and the attended length only grow, so of a run of equal chunks
    # the last costs most: only the last full chunk and the shorter tail are costed.
    if full:
        _advance_many(s, state, chunk_size, full - 1)
        candidates.append(_chunk_peak(s, state, chunk_size, start,
                                      f"chunk {full}/{count} ({chunk_size} tokens over {state.offset})"))
        _advance_many(s, state, chunk_size, 1)
    if rest:
        candidates.append(_chunk_peak(s, state, rest, start,
                                      f"chunk {count}/{count} ({rest} tokens over {state.offset})"))
        _advance_many(s, state, rest, 1)
    if join:
        candidates.append(_join_peak(s, state, start))
    best = max(candidates, key=lambda b: b.total)
    held = max(sum(c.components.get(name, 0) for name in CACHE_COMPONENTS) for c in candidates)
    return PeakBreakdown(best.total, best.components, best.step, dims, kv_bytes=held,
                         kv_bytes_per_token=s.growing_kv_row)


def _advance_many(s: _Settings, state: _CacheState, tokens: int, count: int) -> None:
    """Append ``count`` chunks of ``tokens``, jumping over the chunks that fit."""
    window = s.dims.sliding_window
    if window and count:
        # min(x, w - 1) + c, applied k times, is min(x + k c, w - 1 + c).
        state.window_length = min(state.window_length + count * tokens, window - 1 + tokens)
    remaining = count
    while remaining:
        fitting = min(remaining, (state.full_capacity - state.offset) // tokens)
        if fitting:
            state.offset += fitting * tokens
            remaining -= fitting
            continue
        state.full_capacity = grown_capacity(state.offset, state.full_capacity, tokens)
        state.offset += tokens
        remaining -= 1


def _cache_bytes(s: _Settings, state: _CacheState) -> dict[str, int]:
    """Bytes each kind of cache holds in ``state``."""
    dims = s.dims
    linear = 0
    if dims.linear is not None and state.offset:
        linear = dims.count(LINEAR) * dims.linear.state_bytes(s.dtype_bytes)
    return {"kv_cache": dims.count(FULL) * state.full_capacity * s.kv_row,
            "window_cache": dims.count(SLIDING) * state.window_length * s.window_row,
            "recurrent_state": linear,
            "kv_tile_window": dims.count(FULL) * s.tile_window if state.offset else 0}


def _cache_components(s: _Settings, state: _CacheState, start: dict[str, int]) -> dict[str, int]:
    """What the caches hold in ``state`` beyond ``start``, the part already in use."""
    return {name: max(0, held - start.get(name, 0)) for name, held in _cache_bytes(s, state).items()}


def _chunk_peak(s: _Settings, before: _CacheState, tokens: int, start: dict[str, int],
                label: str) -> PeakBreakdown:
    dims = s.dims
    b = s.dtype_bytes
    after = _CacheState(before.offset, before.full_capacity, before.window_length)
    _advance_many(s, after, tokens, 1)
    components = _cache_components(s, after, start)

    # A growing layer holds its old buffer and the zero block next to the new buffer
    # until its attention has read it; the eval loop can reach the next layer's growth
    # before the first one is freed.
    per_layer = 0
    if after.full_capacity != before.full_capacity and dims.count(FULL):
        kept = before.offset if before.offset % KV_STEP else before.full_capacity
        per_layer = (before.full_capacity + after.full_capacity - kept) * s.kv_row
    if dims.count(SLIDING):
        per_layer = max(per_layer, before.window_length * s.window_row)
    growth = min(2, dims.count(FULL) + dims.count(SLIDING)) * per_layer

    # The transient is one layer's allocations (see LAYER_MARGIN); the last layer's
    # attention and MLP feed only the logits and never run unless those are evaluated.
    computed = dims.layer_kinds if s.full_logits else dims.layer_kinds[:-1]
    # Half-precision models still run norms, residual clips and RoPE tables in float32.
    wide = max(b, 4)
    fused = s.backend == "metal" and dims.head_dim in (64, 80, 128) and dims.latent is None
    scores = 0
    if FULL in computed and dims.latent is not None:
        scores = latent_attention_bytes(dims, tokens, after.offset, b)
    elif FULL in computed and not fused:
        scores = attention_scores_bytes(dims.num_heads, tokens, after.offset, b, dims.attention_sinks)
    if SLIDING in computed and not fused:
        # Sliding layers pass their window mask (counted below) as an array: nothing to drop.
        scores = max(scores, attention_scores_bytes(dims.num_heads, tokens, after.window_length, b,
                                                    dims.attention_sinks))
    if SLIDING in dims.layer_kinds and tokens > 1:
        # The window mask is an array built once per forward and kept through every layer.
        scores += tokens * after.window_length
    layer = {"cache_growth_copy": growth}
    if FULL in computed or SLIDING in computed:
        layer["attention_scores"] = scores
        layer["activations"] = attention_activation_bytes(dims, tokens, wide)
    if FULL in computed and s.kv_bits and (s.backend == "cpu" or s.tiled):
        layer["dequantized_kv"] = dequantized_kv_bytes(dims, after.offset, b)
    if FULL in computed and s.tiled:
        layer["tiled_kv_copies"] = tiled_kv_copy_bytes(dims, after.offset, tokens, b, s.value_row)
    if computed:
        dense = mlp_bytes(dims, tokens, wide) if dims.intermediate_size else 0
        expert = moe_bytes(dims, tokens, wide)
        layer["moe_experts" if expert >= dense and expert else "mlp"] = max(dense, expert)
    layer["margin"] = math.ceil((LAYER_MARGIN - 1) * (sum(layer.values()) - growth))
    phases = [layer]
    if LINEAR in dims.layer_kinds:
        # The last layer's recurrent state is cache state, so its scan always runs.
        phases.append({"linear_attention_scan": linear_scan_bytes(dims, tokens, b, s.backend)})
    components.update(max(phases, key=lambda phase: sum(phase.values())))
    if s.full_logits:
        components["logits"] = logits_bytes(dims, tokens, b)
    components["overhead"] = FIXED_OVERHEAD_BYTES
    return PeakBreakdown(sum(components.values()), components, label)


def _join_peak(s: _Settings, before: _CacheState, start: dict[str, int]) -> PeakBreakdown:
    """The prompt's last token in a one-token forward, then the join to a decode lane:
    each layer's cache is copied into a batch cache of exactly ``offset`` tokens, which
    then grows one step (sliding layers: a window, updated in place) while the
    per-request cache is freed."""
    dims = s.dims
    b = s.dtype_bytes
    offset = before.offset
    window = dims.sliding_window or 0
    after = _CacheState(offset + 1, offset + KV_STEP, 0)
    if window:
        merged = min(offset, window)
        after.window_length = merged if merged >= window else min(merged + KV_STEP, window)
    components = _cache_components(s, after, start)
    # A layer holds its per-request buffer, the copy and the zero block of its growth at
    # once; as with growth, the eval loop can reach the next layer's copy before the
    # first per-request buffer is freed.
    per_layer = 0
    if dims.count(FULL):
        per_layer = (before.full_capacity + offset + KV_STEP) * s.kv_row
    if dims.count(SLIDING):
        per_layer = max(per_layer, (before.window_length + window) * s.window_row)
    copies = min(2, dims.count(FULL) + dims.count(SLIDING)) * per_layer
    if dims.linear is not None:
        copies += min(2, dims.count(LINEAR)) * dims.linear.state_bytes(b)
    components["decode_join_copy"] = copies
    components["logits"] = logits_bytes(dims, 1, b)
    wide = max(b, 4)
    components["activations"] = (attention_activation_bytes(dims, 1, wide)
                                 + max(mlp_bytes(dims, 1, wide), moe_bytes(dims, 1, wide))
                                 + attention_scores_bytes(dims.num_heads, 1, after.full_capacity, b,
                                                          dims.attention_sinks))
    if dims.count(FULL) and s.kv_bits and (s.backend == "cpu" or s.tiled):
        components["dequantized_kv"] = dequantized_kv_bytes(dims, after.full_capacity, b)
    if dims.count(FULL) and s.tiled:
        components["tiled_kv_copies"] = tiled_kv_copy_bytes(dims, after.full_capacity, 1, b, s.value_row)
    components["overhead"] = FIXED_OVERHEAD_BYTES
    return PeakBreakdown(sum(components.values()), components, f"first token over {offset}")


def estimate_for_config(config: Mapping[str, Any], new_tokens: int, cached_tokens: int = 0,
                        chunk_size: int = 512, **options: Any) -> PeakBreakdown:
    """:func:`estimate_prefill_peak` straight from a config mapping."""
    return estimate_prefill_peak(ModelDims.from_config(config), new_tokens, cached_tokens,
                                 chunk_size, **options)
