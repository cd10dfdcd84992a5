"""The ``dflash`` drafter: the block-diffusion draft model of the DFlash paper.

The draft model itself is z-lab's reference MLX implementation, ``dflash.model_mlx``
(PyPI ``dflash``, MIT; installed with ``--no-deps``, since its metadata pins a
training stack it does not import). Its draft is a few transformer layers that attend
to a context projected from the target's hidden states at chosen layers
(``target_layer_ids``) and denoise a whole block in one forward: the anchor token
followed by ``block_size - 1`` mask tokens, whose logits (through the target's own
embedding and LM head, shared, not copied) are the draft.

What this module adds is the wiring into the speculative engine: the weights load from
a local directory (``draft_path``, or a repo already in the local Hugging Face cache;
nothing is downloaded), the target's hidden states come from :mod:`.hidden` during the
target's own prefill and verify forwards, and the draft's context cache takes each
committed token's hidden state exactly once, chunk by chunk, so what it holds stays
bounded by the prompt's KV-like footprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from omlx_core.engine import SamplingParams
from omlx_core.scheduling import KeyStream, target_log_probs
from omlx_core.scheduling import Draft, DraftFootprint, Drafter, DraftState
from omlx_core.plugins.dflash.hidden import decoder_layers


def read_draft_config(path: Path) -> tuple[Any, bool]:
    """``(DFlashConfig, is_dflash2)`` from a DFlash draft directory's ``config.json``."""
    from dflash.model_mlx import DFlashConfig

    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"DFlash draft directory {path} has no config.json; set draft_path to "
                         "a DFlash draft model directory")
    raw = json.loads(file.read_text())
    block = raw.get("dflash_config") or {}
    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "head_dim", "intermediate_size",
                               "vocab_size", "rms_norm_eps", "max_position_embeddings",
                               "num_target_layers") if key not in raw]
    missing += [f"dflash_config.{key}" for key in ("target_layer_ids", "mask_token_id")
                if key not in block]
    if missing:
        raise ValueError(f"{file} is not a DFlash draft config: it lacks {', '.join(missing)}")
    layer_types = tuple(raw.get("layer_types") or ("full_attention",) * raw["num_hidden_layers"])
    if set(layer_types) != {"full_attention"}:
        raise ValueError(f"{file}: sliding-window draft layers are not supported by this engine "
                         f"(layer_types {sorted(set(layer_types))}); use a full-attention draft")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    config = DFlashConfig(
        hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        intermediate_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw.get("rope_theta", (rope or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=raw["max_position_embeddings"],
        block_size=int(block.get("block_size", raw.get("block_size", 16))),
        target_layer_ids=tuple(int(i) for i in block["target_layer_ids"]),
        num_target_layers=raw["num_target_layers"], mask_token_id=int(block["mask_token_id"]),
        rope_scaling=rope, layer_types=layer_types,
        final_logit_softcapping=block.get("final_logit_softcapping",
                                          raw.get("final_logit_softcapping")),
        input_embedding_scale=float(block.get("input_embedding_scale", 1.0)),
        output_multiplier=float(block.get("output_multiplier", 1.0)),
        conv_kernel_size=int(block.get("conv_kernel_size", 0)),
        conv_group_size=int(block.get("conv_group_size", 0)),
        selector_rank=int(block.get("selector_rank", 0)),
        selector_top_k=int(block.get("selector_top_k", 0)),
        is_causal=raw.get("is_causal"))
    return config, "DFlash2DraftModel" in (raw.get("architectures") or [])


@dataclass
class _BlockState:
    cache: list[Any]
    #: target hidden states of committed tokens not yet in the draft's context cache
    pending: mx.array | None = None


class DFlashDrafter(Drafter):
    """A DFlash block-diffusion draft over the target's hidden states."""

    name = "dflash"

    def __init__(self, path: Path, *, block_size: int | None = None) -> None:
        self.path = Path(path).expanduser()
        self.config, self.dflash2 = read_draft_config(self.path)
        self.block_size = int(block_size or self.config.block_size)
        self.target_layer_ids = tuple(self.config.target_layer_ids)
        self.context_window = int(self.config.max_position_embeddings)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"DFlash draft directory {self.path} has no *.safetensors weights")
        self._files = files
        self._weight_bytes = sum(f.stat().st_size for f in files)
        self.model: Any = None

    def load(self, target: Any) -> None:
        from dflash.model_mlx import DFlash2DraftModel, DFlashDraftModel

        layers = decoder_layers(target)
        config = self.config
        if max(self.target_layer_ids) >= len(layers):
            raise ValueError(f"DFlash draft {self.path} reads target layers {self.target_layer_ids}, "
                             f"but the target has {len(layers)} layers")
        target_hidden = int(getattr(getattr(target, "args", None), "hidden_size", 0) or 0)
        if target_hidden and target_hidden != config.hidden_size:
            raise ValueError(f"DFlash draft {self.path} has hidden_size {config.hidden_size}, the "
                             f"target {target_hidden}: the draft was trained for another model")
        weights: dict[str, mx.array] = {}
        for file in self._files:
            weights.update(mx.load(str(file)))
        model_class = DFlash2DraftModel if self.dflash2 else DFlashDraftModel
        if self.dflash2:
            for name in ("predecessor_codebook", "successor_codebook"):
                key = f"candidate_selector.{name}"
                if key in weights:
                    weights[f"{key}.weight"] = weights.pop(key)
        model = model_class(config)
        model.eval()
        model.load_weights(list(weights.items()))
        mx.eval(model.parameters())
        # The draft reads through the target's embedding and LM head (shared, not copied).
        model.bind(target)
        self.model = model

    def begin(self, prompt: Sequence[int]) -> DraftState:
        return DraftState(extra=_BlockState(self.model.make_cache()))

    def _feed_context(self, state: _BlockState, hidden: mx.array) -> None:
        """Put committed tokens' hidden states into the draft's context cache: a draft
        forward over one mask token stores the context and nothing of the block."""
        mask = mx.array([[self.config.mask_token_id]])
        self.model.hidden_states(mask, hidden, state.cache)
        mx.eval([layer.state for layer in state.cache])

    def prefill(self, state: DraftState, tokens: Sequence[int], hidden: mx.array | None) -> None:
        block: _BlockState = state.extra
        if hidden is None:
            return
        if block.pending is not None:
            self._feed_context(block, block.pending)
        # The newest chunk waits: the first block forward takes it as its context.
        block.pending = hidden

    def propose(self, state: DraftState, history: Sequence[int], limit: int,
                sampling: SamplingParams, keys: KeyStream | None) -> Draft:
        block: _BlockState = state.extra
        width = min(self.block_size, limit + 1)
        if width <= 1 or block.pending is None:
            return Draft([])
        tokens = mx.array([[int(history[-1])] + [self.config.mask_token_id] * (width - 1)])
        context, block.pending = block.pending, None
        if self.dflash2:
            temperature = sampling.temperature
            drafted, candidates, q = self.model.propose(tokens, context, block.cache, temperature,
                                                        logits_start=1)
            draft = drafted[0].tolist()
            if temperature == 0 or q is None:
                return Draft(draft)
            full = mx.zeros((q.shape[1], self.config.vocab_size), dtype=mx.float32)
            full = mx.put_along_axis(full, candidates[0], q[0].astype(mx.float32), axis=-1)
            return Draft(draft, mx.log(full))
        logits = self.model(tokens, context, block.cache, logits_start=1)[0]
        if sampling.temperature == 0:
            return Draft(mx.argmax(logits, axis=-1).tolist())
        log_q = target_log_probs(logits, sampling)
        draft = [int(mx.random.categorical(row, key=keys.next()).item()) for row in log_q]
        return Draft(draft, log_q)

    def commit(self, state: DraftState, fed: Sequence[int], kept: int,
               hidden: mx.array | None) -> None:
        block: _BlockState = state.extra
        if hidden is None:
            return
        # The kept positions' hidden states are the next block's new context: the anchor
        # and the accepted drafts (the new anchor is the target's own next token).
        block.pending = hidden if block.pending is None else mx.concatenate(
            [block.pending, hidden], axis=1)

    def footprint(self) -> DraftFootprint:
        config = self.config
        hidden = config.hidden_size
        context = len(self.target_layer_ids) * hidden
        return DraftFootprint(
            pending_weight_bytes=0 if self.model is not None else self._weight_bytes,
            weight_bytes=self._weight_bytes,
            kv_bytes_per_token=2 * config.num_hidden_layers * config.num_key_value_heads
            * config.head_dim * 4,
            # per context token: the captured target hidden states, their projection and
            # the draft layers' activations
            transient_bytes_per_token=4 * (2 * context + 6 * hidden + 3 * config.intermediate_size))


__all__ = ["DFlashDrafter", "read_draft_config"]
