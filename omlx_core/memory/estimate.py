"""The prefill peak-memory estimate: how many bytes a prefill adds on top of memory
already in use (weights and every other request), derived from a model's config alone.

The estimate mirrors what mlx-lm and mlx actually allocate, measured with
``mx.get_peak_memory()`` on real forwards (``benchmarks.estimator``):

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

Everything here is a pure function of numbers. A key a config leaves out is filled from
the defaults mlx-lm builds that architecture with (its ``ModelArgs``, imported only then)
and listed in :attr:`ModelDims.defaulted`; a config the estimator still cannot read
raises :class:`EstimatorDisabledError`, never a silent guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

#: Tokens by which mlx-lm's KVCache/QuantizedKVCache/BatchKVCache buffers grow.
KV_STEP = 256

#: Config blocks a multimodal model nests its language model's dims in.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
#: Keys that make a nested block the language model (the top level may be the vision tower).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer")

FULL, SLIDING, LINEAR = "full", "sliding", "linear"

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

#: model_types whose mlx-lm attention caches the compressed latent (one head of
#: ``kv_lora_rank + qk_rope_head_dim``); other MLA models cache expanded per-head K/V.
LATENT_CACHE_MODEL_TYPES = frozenset({
    "deepseek_v3", "kimi_k2", "joyai_llm_flash", "glm4_moe_lite", "mistral4",
    "longcat_flash", "bailing_moe_v3", "kimi_k3",
})
#: model_types with GatedDeltaNet layers (ArraysCache of conv + recurrent state) every
#: ``full_attention_interval``-th layer being full attention.
GATED_DELTA_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})
#: model_types whose mlx-lm make_cache uses RotatingKVCache for "sliding_attention"
#: entries of ``layer_types``; any other model with a window is costed as full attention.
LAYER_TYPES_SLIDING_MODEL_TYPES = frozenset({"llama", "mistral", "ministral3", "olmo3"})
#: model_types whose recurrent or hybrid layers this estimator does not model.
UNMODELED_RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h", "jamba",
    "granitemoehybrid", "plamo2", "lfm2", "lfm2_moe", "lfm2-vl", "recurrent_gemma",
    "rwkv7", "kimi_linear", "bailing_moe_linear", "bailing_hybrid", "olmo_hybrid",
    "baichuan_m1",
})
_RECURRENT_CONFIG_KEYS = ("ssm_state_size", "mamba_d_state", "state_size", "mamba_n_heads",
                          "hybrid_override_pattern", "layers_block_type", "attn_layer_indices")


class EstimatorDisabledError(ValueError):
    """The model's config cannot be turned into an estimate; the caller must log this
    loudly and run without the estimator rather than guess."""


# -- model dims ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearAttentionDims:
    """A GatedDeltaNet layer's shape (qwen3_next ``linear_*`` keys)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """Conv state (activation dtype) + recurrent state (always float32), one layer."""
        conv = (self.conv_kernel - 1) * self.conv_dim * dtype_bytes
        recurrent = self.num_value_heads * self.value_head_dim * self.key_head_dim * 4
        return conv + recurrent


@dataclass(frozen=True)
class LatentAttentionDims:
    """Multi-head latent attention (deepseek_v3): what is cached and what is expanded."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoeDims:
    """Routed experts per MoE layer; ``shared_intermediate_size`` 0 when none."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a language model that decide its prefill memory."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    latent: LatentAttentionDims | None = None
    moe: MoeDims | None = None
    linear: LinearAttentionDims | None = None
    #: which config block the dims came from: "top level" or e.g. "text_config"
    source: str = "top level"
    #: keys the config left out, taken from the defaults mlx-lm builds the model with
    defaulted: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelDims:
        """Dims of the language model described by an HF/mlx-lm ``config.json`` mapping.

        A multimodal config's ``text_config``/``language_config``/``llm_config`` wins
        whenever it has a layer count, even if the top level has one too (that one may
        be the vision tower's).

        :raises EstimatorDisabledError: a needed dim is missing or not a positive int
            (the message names the key and its value), or the architecture has layers
            this estimator does not model.
        """
        if not isinstance(config, Mapping):
            raise EstimatorDisabledError(f"model config is a {type(config).__name__}, not a mapping")
        block, source = _language_block(config)
        model_type = str(block.get("model_type") or config.get("model_type") or "")
        # A nested language model may be typed "<family>_text" or only at the top level.
        families = {model_type, model_type.removesuffix("_text"), str(config.get("model_type") or "")}
        where = "" if source == "top level" else f"{source}."
        if source != "top level":
            overrides = _WRAPPER_TOP_LEVEL_OVERRIDES.get(str(config.get("model_type") or ""), {})
            block = {**block, **{key: config.get(key, value) for key, value in overrides.items()}}
        reader = _DimReader(block, where, _LazyFallback(config, block, source != "top level"))

        if families & UNMODELED_RECURRENT_MODEL_TYPES or (
                not families & GATED_DELTA_MODEL_TYPES
                and any(key in block for key in _RECURRENT_CONFIG_KEYS)):
            raise EstimatorDisabledError(
                f"model_type {model_type!r} has recurrent (state-space or linear-attention) "
                "layers whose prefill memory this estimator does not model")

        num_layers = reader.int("num_hidden_layers", "n_layer", "n_layers", "num_layers")
        hidden = reader.int("hidden_size", "n_embd", "d_model")
        num_heads = reader.int("num_attention_heads", "n_head", "n_heads", "num_heads")
        num_kv_heads = reader.int("num_key_value_heads", "n_head_kv", "num_kv_heads", "n_kv_heads",
                                  default=num_heads)
        head_dim = reader.int("head_dim", default=None)
        if head_dim is None:
            if hidden % num_heads:
                raise EstimatorDisabledError(
                    f"config has no head_dim and {where}hidden_size={hidden} is not a multiple of "
                    f"num_attention_heads={num_heads}")
            head_dim = hidden // num_heads
        legacy = "n_layer" in block and "num_hidden_layers" not in block
        intermediate = reader.int("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                                  default=4 * hidden if legacy else None)
        vocab = reader.int("vocab_size", "padded_vocab_size", "n_vocab")
        v_head_dim = head_dim
        if num_heads % num_kv_heads:
            raise EstimatorDisabledError(
                f"{where}num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}")

        latent = None
        if "kv_lora_rank" in block and block.get("kv_lora_rank") is not None:
            mla = LatentAttentionDims(
                kv_lora_rank=reader.int("kv_lora_rank"),
                qk_rope_head_dim=reader.int("qk_rope_head_dim"),
                qk_nope_head_dim=reader.int("qk_nope_head_dim"),
                v_head_dim=reader.int("v_head_dim"))
            if families & LATENT_CACHE_MODEL_TYPES:
                latent = mla
            # Every other MLA model in mlx-lm caches per-head keys (nope + rope) and values.
            num_kv_heads = num_heads
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            v_head_dim = mla.v_head_dim

        moe = _moe_dims(reader)
        linear = None
        kinds = [FULL] * num_layers
        window = None
        if families & GATED_DELTA_MODEL_TYPES:
            linear = LinearAttentionDims(
                num_key_heads=reader.int("linear_num_key_heads"),
                num_value_heads=reader.int("linear_num_value_heads"),
                key_head_dim=reader.int("linear_key_head_dim"),
                value_head_dim=reader.int("linear_value_head_dim"),
                conv_kernel=reader.int("linear_conv_kernel_dim"))
            interval = reader.int("full_attention_interval", default=4)
            kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        elif "gemma3" in families:
            window = reader.int("sliding_window", default=512)
            pattern = reader.int("sliding_window_pattern", default=6)
            kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        elif families & LAYER_TYPES_SLIDING_MODEL_TYPES and block.get("layer_types"):
            layer_types = block["layer_types"]
            if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
                raise EstimatorDisabledError(
                    f"{where}layer_types={layer_types!r} does not list one type per layer "
                    f"({num_layers} layers)")
            if "sliding_attention" in layer_types:
                window = reader.int("sliding_window")
                kinds = [SLIDING if t == "sliding_attention" else FULL for t in layer_types]
        elif isinstance(block.get("layer_types"), (list, tuple)) and any(
                "linear" in str(t) or "mamba" in str(t) for t in block["layer_types"]):
            raise EstimatorDisabledError(
                f"model_type {model_type!r} lists linear/recurrent layer_types this estimator "
                "does not model")

        return cls(model_type=model_type, num_layers=num_layers, hidden_size=hidden,
                   num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   v_head_dim=v_head_dim, intermediate_size=intermediate or 0,
                   vocab_size=vocab, layer_kinds=tuple(kinds), sliding_window=window,
                   latent=latent, moe=moe, linear=linear, source=source,
                   defaulted=tuple(reader.defaulted))

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    def kv_bytes_per_token(self, dtype_bytes: int, kv_bits: int | None = None,
                           kv_group_size: int = 64) -> int:
        """Bytes one token adds to one attention layer's cache (full or sliding)."""
        if self.latent is not None:
            widths = (self.latent.kv_lora_rank, self.latent.qk_rope_head_dim)
            heads = 1
        else:
            widths = (self.head_dim, self.v_head_dim)
            heads = self.num_kv_heads
        return heads * sum(quantized_row_bytes(w, dtype_bytes, kv_bits, kv_group_size)
                           for w in widths)


class _DimReader:
    """Reads positive-int dims from one config block, naming the key in every error.

    A key the block lacks is taken from ``fallback`` (the values mlx-lm itself builds the
    model with) and recorded in :attr:`defaulted`.
    """

    _MISSING = object()

    def __init__(self, block: Mapping[str, Any], where: str, fallback: Mapping[str, Any]):
        self.block = block
        self.where = where
        self.fallback = fallback
        self.defaulted: list[str] = []

    def int(self, *keys: str, default: Any = _MISSING) -> Any:
        for key in keys:
            if key in self.block and self.block[key] is not None:
                return _positive_int(self.block[key], self.where + key)
        for key in keys:
            value = self.fallback.get(key)
            # A default of None or 0 is mlx-lm's "not used" (no experts, derived later).
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                self.defaulted.append(self.where + key)
                return value
        if default is not _DimReader._MISSING:
            return default
        names = " / ".join(self.where + k for k in keys)
        raise EstimatorDisabledError(f"model config has no {names}; cannot estimate prefill memory")


# mlx-lm multimodal wrappers that fill in their nested language model's config before
# building it (mlx_lm/models/gemma3.py: heads 8, kv heads 4, the top level's vocab size).
_WRAPPER_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"num_attention_heads": 8, "num_key_value_heads": 4},
}
_WRAPPER_TOP_LEVEL_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3": {"vocab_size": 262208},
}


def _mlx_lm_fallback(config: Mapping[str, Any], block: Mapping[str, Any], nested: bool) -> dict[str, Any]:
    """The defaults mlx-lm builds this model with for keys its config leaves out."""
    fallback = _mlx_lm_arg_defaults(str(block.get("model_type") or config.get("model_type") or ""))
    top_type = str(config.get("model_type") or "")
    if nested:
        fallback.update(_WRAPPER_TEXT_DEFAULTS.get(top_type, {}))
    return fallback


def _mlx_lm_arg_defaults(model_type: str) -> dict[str, Any]:
    # Imported lazily and only when a key is missing: mlx-lm's ModelArgs dataclass
    # defaults are the values the loaded model really uses.
    import dataclasses
    import importlib

    try:
        from mlx_lm.utils import MODEL_REMAPPING

        module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
        fields = dataclasses.fields(module.ModelArgs)
    except Exception:  # not an mlx-lm architecture (or no mlx-lm): no defaults to offer
        return {}
    return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


class _LazyFallback(Mapping[str, Any]):
    """mlx-lm's defaults for a config, looked up only if some key is actually missing."""

    def __init__(self, config: Mapping[str, Any], block: Mapping[str, Any], nested: bool):
        self._args = (config, block, nested)
        self._values: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._values is None:
            self._values = _mlx_lm_fallback(*self._args)
        return self._values

    def __getitem__(self, key: str) -> Any:
        return self._load()[key]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


def _positive_int(value: Any, key: str) -> int:
    # bool is an int subclass and a float like 64.0 is a JSON artefact: reject the
    # first, accept the second only when integral.
    if isinstance(value, bool):
        ok = False
    elif isinstance(value, int):
        ok = value > 0
    elif isinstance(value, float):
        ok = value.is_integer() and value > 0
    else:
        ok = False
    if not ok:
        raise EstimatorDisabledError(
            f"model config {key}={value!r} ({type(value).__name__}) is not a positive integer")
    return int(value)


def _language_block(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, Mapping) and any(k in nested for k in LAYER_COUNT_KEYS):
            return nested, key
    return config, "top level"


def _moe_dims(reader: _DimReader) -> MoeDims | None:
    experts = reader.int("num_experts", "n_routed_experts", "num_local_experts", default=None)
    if experts is None:
        return None
    per_token = reader.int("num_experts_per_tok", "moe_top_k", "top_k")
    # Mixtral names its expert width intermediate_size.
    width = reader.int("moe_intermediate_size", "intermediate_size")
    shared = reader.int("shared_expert_intermediate_size", default=0)
    n_shared = reader.int("n_shared_experts", default=0)
    return MoeDims(num_experts=experts, experts_per_token=per_token, intermediate_size=width,
                   shared_intermediate_size=shared + n_shared * width)


# -- component formulas -----------------------------------------------------------------


def quantized_row_bytes(width: int, dtype_bytes: int, kv_bits: int | None, group_size: int) -> int:
    """Bytes of one cached row of ``width`` values: plain, or mlx-quantized (packed
    uint32 words plus a scale and a bias per group, in the activation dtype)."""
    if kv_bits is None:
        return width * dtype_bytes
    groups = math.ceil(width / group_size)
    return math.ceil(width * kv_bits / 32) * 4 + 2 * groups * dtype_bytes


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


def attention_scores_bytes(heads: int, query_tokens: int, key_tokens: int, dtype_bytes: int) -> int:
    """The materialized score matrix plus its one-byte causal mask (CPU SDPA fallback)."""
    scores = heads * query_tokens * key_tokens * dtype_bytes
    mask = query_tokens * key_tokens if query_tokens > 1 else 0
    return scores + mask


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


@dataclass(frozen=True)
class PeakBreakdown:
    """An estimated peak: the total and the named parts it is made of, at the step of the
    prefill where the peak falls."""

    total: int
    components: Mapping[str, int]
    step: str = ""
    dims: ModelDims | None = field(default=None, compare=False, repr=False)

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
    _check_counts(new_tokens=new_tokens, cached_tokens=cached_tokens, chunk_size=chunk_size,
                  dtype_bytes=dtype_bytes)
    if new_tokens == 0:
        return PeakBreakdown(0, {}, "nothing to prefill", dims)
    if backend not in ("cpu", "cuda", "metal"):
        raise ValueError(f"backend must be 'cpu', 'cuda' or 'metal', not {backend!r}")
    settings = _Settings(dims, dtype_bytes, kv_bits, kv_group_size, full_logits, backend)
    candidates = [_simulate(settings, new_tokens, chunk_size, cached_tokens, cached_kv_resident,
                            join=False)]
    if first_token:
        candidates.append(_simulate(settings, new_tokens - 1, chunk_size, cached_tokens,
                                    cached_kv_resident, join=True))
    return max(candidates, key=lambda b: b.total)


def _check_counts(**counts: int) -> None:
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
        return self.dims.kv_bytes_per_token(self.dtype_bytes, self.kv_bits, self.kv_group_size)


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
    return PeakBreakdown(best.total, best.components, best.step, dims)


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
            "window_cache": dims.count(SLIDING) * state.window_length * s.kv_row,
            "recurrent_state": linear}


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
        per_layer = max(per_layer, before.window_length * s.kv_row)
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
        scores = attention_scores_bytes(dims.num_heads, tokens, after.offset, b)
    if SLIDING in computed and not fused:
        scores = max(scores, attention_scores_bytes(dims.num_heads, tokens, after.window_length, b))
    if SLIDING in dims.layer_kinds and tokens > 1:
        # The window mask is an array built once per forward and kept through every layer.
        scores += tokens * after.window_length
    layer = {"cache_growth_copy": growth}
    if FULL in computed or SLIDING in computed:
        layer["attention_scores"] = scores
        layer["activations"] = attention_activation_bytes(dims, tokens, wide)
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
    """The prompt's last token in a one-token forward, then the join to mlx-lm's
    BatchGenerator: each layer's cache is copied into a batch cache of exactly ``offset`` tokens, which then grows one step
    (sliding layers: a window, updated in place) while the per-request cache is freed."""
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
        per_layer = max(per_layer, (before.window_length + window) * s.kv_row)
    copies = min(2, dims.count(FULL) + dims.count(SLIDING)) * per_layer
    if dims.linear is not None:
        copies += min(2, dims.count(LINEAR)) * dims.linear.state_bytes(b)
    components["decode_join_copy"] = copies
    components["logits"] = logits_bytes(dims, 1, b)
    wide = max(b, 4)
    components["activations"] = (attention_activation_bytes(dims, 1, wide)
                                 + max(mlp_bytes(dims, 1, wide), moe_bytes(dims, 1, wide))
                                 + attention_scores_bytes(dims.num_heads, 1, after.full_capacity, b))
    components["overhead"] = FIXED_OVERHEAD_BYTES
    return PeakBreakdown(sum(components.values()), components, f"first token over {offset}")


def estimate_for_config(config: Mapping[str, Any], new_tokens: int, cached_tokens: int = 0,
                        chunk_size: int = 512, **options: Any) -> PeakBreakdown:
    """:func:`estimate_prefill_peak` straight from a config mapping."""
    return estimate_prefill_peak(ModelDims.from_config(config), new_tokens, cached_tokens,
                                 chunk_size, **options)



# -- vision models ---------------------------------------------------------------------------

#: vision configs under these keys hold a VLM's image encoder
VISION_CONFIG_KEYS = ("vision_config", "vision_tower_config")


@dataclass(frozen=True)
class VisionDims:
    """The numbers of a VLM's vision tower that decide the memory encoding images takes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_size: int
    #: positions one image runs through the tower (its patches, plus a CLS token)
    positions: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionDims:
        """Dims of the vision tower of a VLM ``config.json`` mapping.

        :raises EstimatorDisabledError: the config has no vision block, or a needed dim is
            missing or not a positive int.
        """
        block = next((config[key] for key in VISION_CONFIG_KEYS
                      if isinstance(config.get(key), Mapping)), None)
        if block is None:
            raise EstimatorDisabledError("the model config has no vision_config; it cannot "
                                         "encode images")
        where = "vision_config."
        values = {}
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "image_size", "patch_size"):
            if key not in block:
                raise EstimatorDisabledError(f"{where}{key} is missing")
            values[key] = _positive_int(block[key], where + key)
        patches = (values["image_size"] // values["patch_size"]) ** 2
        # CLIP towers (LLaVA's) prepend a class token to the patches.
        cls_token = 1 if "clip" in str(block.get("model_type", "")) else 0
        return cls(values["num_hidden_layers"], values["hidden_size"], values["intermediate_size"],
                   values["num_attention_heads"], values["image_size"], patches + cls_token)


def image_features_bytes(vision: VisionDims, text_hidden: int, images: int, dtype_bytes: int = 4) -> int:
    """The images' features the language model takes (one row per image token, at most
    one per vision position), held while prefill feeds them."""
    return images * vision.positions * text_hidden * dtype_bytes


def estimate_vision_peak(vision: VisionDims, text_hidden: int, images: int,
                         dtype_bytes: int = 4) -> PeakBreakdown:
    """Peak bytes encoding ``images`` images (all at once, as the vlm engine does) adds.

    Measured on the CPU backend (``python -m benchmarks.estimator``): the pixels
    arrive as float32 and the patch embedding holds two more copies of them (the
    channels-last transpose and the patch unfold); one attention layer's scores
    (heads x positions^2) live at a time, next to its queries, keys, values and
    output; every layer's hidden states are kept (mlx-vlm
    asks the tower for them all); the projector and the merge write each position in
    the text width, three copies at most.
    """
    _check_counts(new_tokens=images, cached_tokens=0, chunk_size=1, dtype_bytes=dtype_bytes)
    if images == 0:
        return PeakBreakdown(0, {}, "no images")
    p = vision.positions
    pixels = images * 3 * vision.image_size ** 2 * 4
    components = {
        "pixels": 3 * pixels,
        "vision_scores": images * vision.num_heads * p * p * max(dtype_bytes, 4),
        "vision_attention": 4 * images * p * vision.hidden_size * dtype_bytes,
        "vision_hidden_states": images * (vision.num_layers + 1) * p * vision.hidden_size * dtype_bytes,
        "vision_mlp": 2 * images * p * vision.intermediate_size * dtype_bytes,
        "image_features": 3 * image_features_bytes(vision, text_hidden, images, dtype_bytes),
        "overhead": FIXED_OVERHEAD_BYTES,
    }
    return PeakBreakdown(sum(components.values()), components, f"encoding {images} image(s)")


def estimate_with_images(dims: ModelDims, vision: VisionDims, text: PeakBreakdown, *,
                         images: int, new_tokens: int, dtype_bytes: int = 4,
                         kv_bits: int | None = None, kv_group_size: int = 64) -> PeakBreakdown:
    """``text`` (the prefill of ``new_tokens``) with ``images`` encoded first
    (:func:`combine_vision_peak`)."""
    encoding = estimate_vision_peak(vision, dims.hidden_size, images, dtype_bytes)
    features = image_features_bytes(vision, dims.hidden_size, images, dtype_bytes)
    kv = dims.kv_bytes_per_token(dtype_bytes, kv_bits, kv_group_size) * len(dims.layer_kinds) * new_tokens
    return combine_vision_peak(text, encoding, features, kv)


def combine_vision_peak(text: PeakBreakdown, vision: PeakBreakdown, features_bytes: int,
                        kv_bytes: int) -> PeakBreakdown:
    """A VLM prefill's peak: the larger of encoding the images (over the KV the prompt
    may hold by then, ``kv_bytes`` at most) and the text prefill with the image features
    (``features_bytes``) held."""
    if not vision.components:
        return text
    encoding = vision.total + kv_bytes
    if encoding > text.total:
        components = {**vision.components, "kv_cache_before_images": kv_bytes}
        return PeakBreakdown(encoding, components, vision.step, text.dims)
    components = {**text.components, "image_features": features_bytes}
    return PeakBreakdown(text.total + features_bytes, components, text.step, text.dims)
