"""A language model's dims, read from its ``config.json``: the numbers that decide
its prefill memory (layers and their kinds, heads, widths, experts, windows).

A key a config leaves out is filled from the defaults mlx-lm builds that architecture
with (its ``ModelArgs``, imported only then) and listed in :attr:`ModelDims.defaulted`;
a config the estimator still cannot read raises :class:`EstimatorDisabledError`, never a
silent guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

#: Config blocks a multimodal model nests its language model's dims in.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
#: Keys that make a nested block the language model (the top level may be the vision tower).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer")

FULL, SLIDING, LINEAR = "full", "sliding", "linear"

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
LAYER_TYPES_SLIDING_MODEL_TYPES = frozenset({"llama", "mistral", "ministral3", "olmo3", "gpt_oss"})
#: model_types whose mlx-lm attention adds learned per-head sinks to the softmax, and
#: the ``layer_types`` mlx-lm builds them with when their config lists none.
ATTENTION_SINK_MODEL_TYPES = frozenset({"gpt_oss"})
_DEFAULT_LAYER_TYPES = {"gpt_oss": ("sliding_attention", "full_attention")}
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
    #: the attention has per-head sinks (gpt-oss): the CPU fallback holds more scores
    attention_sinks: bool = False
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
        elif families & LAYER_TYPES_SLIDING_MODEL_TYPES and (
                block.get("layer_types") or families & set(_DEFAULT_LAYER_TYPES)):
            default = next((_DEFAULT_LAYER_TYPES[f] for f in families if f in _DEFAULT_LAYER_TYPES), ())
            layer_types = block.get("layer_types") or list(default) * (num_layers // len(default))
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
                   latent=latent, moe=moe, linear=linear,
                   attention_sinks=bool(families & ATTENTION_SINK_MODEL_TYPES), source=source,
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
                return positive_int(self.block[key], self.where + key)
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


def positive_int(value: Any, key: str) -> int:
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


def quantized_row_bytes(width: int, dtype_bytes: int, kv_bits: int | None, group_size: int) -> int:
    """Bytes of one cached row of ``width`` values: plain, or mlx-quantized (packed
    uint32 words plus a scale and a bias per group, in the activation dtype)."""
    if kv_bits is None:
        return width * dtype_bytes
    groups = math.ceil(width / group_size)
    return math.ceil(width * kv_bits / 32) * 4 + 2 * groups * dtype_bytes

