"""Drafters: what proposes the tokens a verify forward checks.

A drafter keeps per-request state (:class:`DraftState`) next to the target's cache and
follows one invariant: what it has seen is every committed token except the last, the
*anchor*, which is the first token of the next verify forward. ``propose`` returns up to
``limit`` tokens to follow the anchor; ``commit`` is told which of them the target kept.

- :class:`NgramDrafter` (``ngram``, prompt lookup): the continuation of the most recent
  earlier occurrence of the last ``n`` tokens in the prompt and output so far. No
  weights, nearly free, and right wherever the output copies its input (summaries,
  rewrites, code edits, extraction).
- :class:`ModelDrafter` (``model``): a smaller mlx-lm model with the target's
  vocabulary, decoding greedily (or sampling, for rejection sampling) ``limit`` tokens.
- The block-diffusion draft of the DFlash paper lives in :mod:`.block_diffusion`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from omlx_core.engine import SamplingParams
from omlx_core.plugins.dflash.acceptance import KeyStream, target_log_probs


@dataclass
class Draft:
    """Proposed tokens and, for a sampled draft, the log-distribution each came from."""

    tokens: list[int]
    log_probs: mx.array | None = None


@dataclass
class DraftState:
    """A drafter's per-request state."""

    #: committed tokens the drafter has not folded in yet (the anchor excluded)
    pending: list[int] = field(default_factory=list)
    extra: Any = None


@dataclass(frozen=True)
class DraftFootprint:
    """What a drafter allocates, for the memory estimate."""

    #: bytes of draft weights not yet in memory (loaded ones are in the idle baseline)
    pending_weight_bytes: int = 0
    #: bytes of draft weights in memory
    weight_bytes: int = 0
    #: draft cache bytes per committed token
    kv_bytes_per_token: int = 0
    #: bytes of one draft forward over ``chunk`` tokens beyond its KV (activations,
    #: logits), per token of the chunk
    transient_bytes_per_token: int = 0


class Drafter(abc.ABC):
    """Proposes tokens for one request at a time (the primary path is one request)."""

    #: the name it is chosen by in ``plugin.dflash.drafter``
    name: str = ""
    #: tokens one verify forward checks: the anchor and at most ``block_size - 1`` drafts
    block_size: int = 8
    #: most tokens (prompt and completion) the drafter can serve; ``None``: no limit
    context_window: int | None = None
    #: target layers whose hidden states the drafter reads (``None``: none)
    target_layer_ids: tuple[int, ...] | None = None

    def load(self, target: Any) -> None:
        """Load weights on the MLX thread, once the target is loaded."""

    def begin(self, prompt: Sequence[int]) -> DraftState:
        return DraftState()

    def prefill(self, state: DraftState, tokens: Sequence[int], hidden: mx.array | None) -> None:
        """Fold in a prefill chunk's ``tokens`` (with their target hidden states when
        :attr:`target_layer_ids` is set), right after the target's forward over them."""

    @abc.abstractmethod
    def propose(self, state: DraftState, history: Sequence[int], limit: int,
                sampling: SamplingParams, keys: KeyStream | None) -> Draft:
        """Up to ``limit`` tokens to follow ``history`` (whose last token is the anchor)."""

    def commit(self, state: DraftState, fed: Sequence[int], kept: int,
               hidden: mx.array | None) -> None:
        """The verify forward fed ``fed`` (anchor and drafts); its first ``kept`` stay.
        ``hidden``: their target hidden states when :attr:`target_layer_ids` is set."""
        state.pending.extend(fed[:kept])

    def end(self, state: DraftState) -> None:
        """Release the request's draft state."""

    def footprint(self) -> DraftFootprint:
        return DraftFootprint()


#: acceptance assumed for a prompt-lookup draft before a request has shown its own, by
#: the length of the suffix that matched (longer matches copy more reliably)
NGRAM_PRIOR_ACCEPTANCE = {1: 0.3, 2: 0.5, 3: 0.65, 4: 0.75}


def best_draft_length(acceptance: float, most: int, token_cost: float) -> int:
    """The draft length that maximizes expected tokens per unit of verify cost.

    Drafts ``1..k`` are accepted with probability ``acceptance ** i`` each (a prefix), so
    a cycle emits ``1 + sum(acceptance ** i)`` tokens and costs ``1 + token_cost * k``
    one-token forwards. ``0`` (a plain decode step) unless drafting beats it.
    """
    best, best_rate = 0, 1.0
    expected, power = 1.0, 1.0
    for k in range(1, most + 1):
        power *= acceptance
        expected += power
        rate = expected / (1.0 + token_cost * k)
        if rate > best_rate * 1.02:
            best, best_rate = k, rate
    return best


class NgramDrafter(Drafter):
    """Prompt lookup: the longest ``n`` in ``[ngram_min, ngram_max]`` whose last
    ``n``-gram occurred earlier gives the continuation after its latest occurrence.

    How many of its tokens to draft follows the request's own record: the acceptance
    of earlier drafts from matches of the same length (starting from
    :data:`NGRAM_PRIOR_ACCEPTANCE`) against ``token_cost``, what one more verified
    position costs relative to a one-token forward. Where drafts keep missing (open-
    ended text) it stops drafting, so a miss costs nothing; the estimate drifts back
    toward the prior while it does not draft, so it tries again later.
    """

    name = "ngram"

    def __init__(self, *, block_size: int = 8, ngram_min: int = 1, ngram_max: int = 4,
                 token_cost: float = 0.1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min ({ngram_min}) must be >= 1 and <= ngram_max ({ngram_max})")
        self.block_size = block_size
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.token_cost = token_cost

    def prior(self, n: int) -> float:
        return NGRAM_PRIOR_ACCEPTANCE[min(n, max(NGRAM_PRIOR_ACCEPTANCE))]

    def begin(self, prompt: Sequence[int]) -> DraftState:
        # index[n][gram] = where the continuation of gram's latest occurrence starts
        lengths = range(self.ngram_min, self.ngram_max + 1)
        state = DraftState(extra=_NgramState({n: {} for n in lengths}, [],
                                             {n: self.prior(n) for n in lengths}))
        self._extend(state.extra, prompt)
        return state

    @staticmethod
    def _extend(lookup: "_NgramState", tokens: Sequence[int]) -> None:
        seen = lookup.seen
        for token in tokens:
            length = len(seen)
            for n, grams in lookup.index.items():
                if length >= n:
                    grams[tuple(seen[length - n:])] = length
            seen.append(int(token))

    def propose(self, state: DraftState, history: Sequence[int], limit: int,
                sampling: SamplingParams, keys: KeyStream | None) -> Draft:
        lookup: _NgramState = state.extra
        seen = lookup.seen
        if len(history) > len(seen):
            self._extend(lookup, history[len(seen):])
        lookup.last = None
        if limit <= 0:
            return Draft([])
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(seen) < n:
                continue
            start = lookup.index[n].get(tuple(seen[-n:]))
            if start is None:
                continue
            continuation = seen[start:start + limit]
            k = best_draft_length(lookup.acceptance[n], len(continuation), self.token_cost)
            if k == 0:
                # Not worth a wider forward now; drift back toward the prior.
                lookup.acceptance[n] += 0.05 * (self.prior(n) - lookup.acceptance[n])
                return Draft([])
            lookup.last = n
            return Draft(list(continuation[:k]))
        return Draft([])

    def commit(self, state: DraftState, fed: Sequence[int], kept: int,
               hidden: mx.array | None) -> None:
        lookup: _NgramState = state.extra
        n, lookup.last = lookup.last, None
        drafted = len(fed) - 1
        if n is None or drafted == 0:
            return
        accepted = kept - 1
        trials = accepted + (1 if accepted < drafted else 0)
        observed = accepted / trials
        lookup.acceptance[n] = 0.7 * lookup.acceptance[n] + 0.3 * observed


@dataclass
class _NgramState:
    index: dict[int, dict[tuple[int, ...], int]]
    seen: list[int]
    #: acceptance per drafted position, by matched suffix length
    acceptance: dict[int, float]
    #: the matched length of the draft being verified
    last: int | None = None


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

        from omlx_core.models.loader import load_model
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


__all__ = ["Draft", "DraftFootprint", "DraftState", "Drafter", "ModelDrafter", "NgramDrafter"]
