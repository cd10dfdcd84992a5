"""The dflash engine's draft model: a smaller mlx-lm model with the target's vocabulary,
decoding greedily (or sampling, for rejection sampling) ``limit`` tokens.

The drafter protocol and the prompt-lookup drafter live with the batched engine, which
drafts with it too (:mod:`omlx_core.scheduling.drafters`); the block-diffusion
draft of the DFlash paper lives in :mod:`.block_diffusion`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from omlx_core.engine import SamplingParams
from omlx_core.scheduling import KeyStream, target_log_probs
from omlx_core.scheduling import Draft, DraftFootprint, Drafter, DraftState


class ModelDrafter(Drafter):
    """A smaller mlx-lm model that shares the target's vocabulary."""

    name = "model"

    def __init__(self, path: Path, *, block_size: int = 5) -> None:
        self.path = Path(path).expanduser()
        self.block_size = block_size
        self.model: Any = None
        self._weight_bytes = _weight_file_bytes(self.path)
        self._config = _read_config(self.path)
        window = self._config.get("max_position_embeddings")
        self.context_window = int(window) if isinstance(window, int) and window > 0 else None

    def load(self, target: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        from omlx_core.scheduling import load_model
        from omlx_core.plugins.dflash.rollback import unsupported_layers

        model, _tokenizer = load_model(self.path)
        target_vocab = _vocab_size(target)
        draft_vocab = _vocab_size(model)
        if target_vocab != draft_vocab:
            raise ValueError(f"draft model {self.path} has a vocabulary of {draft_vocab} tokens, "
                             f"the target {target_vocab}; a draft model must share the target's "
                             "tokenizer (set plugin.dflash.draft_path to one that does)")
        cache = make_prompt_cache(model)
        if any(not layer.is_trimmable() for layer in cache) or unsupported_layers(cache):
            raise ValueError(f"draft model {self.path} has cache layers that cannot be cut back "
                             "(recurrent or sliding-window); use a plain attention model as draft")
        self.model = model

    def begin(self, prompt: Sequence[int]) -> DraftState:
        from mlx_lm.models.cache import make_prompt_cache

        return DraftState(extra=make_prompt_cache(self.model))

    def prefill(self, state: DraftState, tokens: Sequence[int], hidden: mx.array | None) -> None:
        self.model(mx.array(list(tokens))[None], cache=state.extra)
        mx.eval([layer.state for layer in state.extra])

    def propose(self, state: DraftState, history: Sequence[int], limit: int,
                sampling: SamplingParams, keys: KeyStream | None) -> Draft:
        if limit <= 0:
            return Draft([])
        cache = state.extra
        feed = state.pending + [int(history[-1])]
        state.pending = []
        tokens: list[int] = []
        rows: list[mx.array] = []
        for _ in range(limit):
            logits = self.model(mx.array(feed)[None], cache=cache)[0, -1:]
            if sampling.temperature == 0:
                token = int(mx.argmax(logits, axis=-1).item())
            else:
                log_q = target_log_probs(logits, sampling)
                token = int(mx.random.categorical(log_q[0], key=keys.next()).item())
                rows.append(log_q[0])
            tokens.append(token)
            feed = [token]
        # The cache now holds the anchor and every draft but the last.
        return Draft(tokens, mx.stack(rows) if rows else None)

    def commit(self, state: DraftState, fed: Sequence[int], kept: int,
               hidden: mx.array | None) -> None:
        drafted = len(fed) - 1
        if drafted == 0:
            # A plain decode step: the anchor was not fed to the draft.
            state.pending.extend(fed[:kept])
            return
        # The draft cache holds fed[:-1] (the anchor and all drafts but the last).
        held = drafted
        if kept <= held:
            for layer in state.extra:
                layer.trim(held - kept)
        else:
            state.pending.extend(fed[held:kept])

    def footprint(self) -> DraftFootprint:
        config = self._config
        layers = int(config.get("num_hidden_layers", 0))
        heads = int(config.get("num_attention_heads", 1))
        kv_heads = int(config.get("num_key_value_heads", heads))
        hidden = int(config.get("hidden_size", 0))
        head_dim = int(config.get("head_dim") or (hidden // max(1, heads)))
        vocab = int(config.get("vocab_size", 0))
        intermediate = int(config.get("intermediate_size", 4 * hidden))
        return DraftFootprint(
            pending_weight_bytes=0 if self.model is not None else self._weight_bytes,
            weight_bytes=self._weight_bytes,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4,
            # a chunk's activations (hidden, q/k/v, MLP) and its last row of logits
            transient_bytes_per_token=4 * (6 * hidden + 3 * intermediate) + 4 * vocab)


def _read_config(path: Path) -> dict[str, Any]:
    import json

    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"draft model directory {path} has no config.json; set "
                         "plugin.dflash.draft_path to an mlx-lm model directory")
    return json.loads(config.read_text())


def _weight_file_bytes(path: Path) -> int:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"draft model directory {path} has no *.safetensors weights")
    return sum(f.stat().st_size for f in files)


def _vocab_size(model: Any) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size:
        return int(size)
    return int(model.model.embed_tokens.weight.shape[0])


__all__ = ["ModelDrafter"]
