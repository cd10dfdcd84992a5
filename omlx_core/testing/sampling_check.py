"""Checks that an engine samples from the model's distribution, for the conformance kit.

An engine's sampled tokens are compared with an independent reference: the model's
next-token log-probabilities computed here with mlx-lm (or given by the test), filtered
the way the OpenAI/vLLM convention says (temperature scales the logits, then top-k,
top-p and min-p cut the scaled distribution, and what is left is renormalized).

The comparison is an exact binomial test per bin with a Bonferroni bound: a correct
engine fails a check with probability at most ``delta`` over the choice of seeds. The
kit uses fixed seeds, so in CI a given engine passes or fails every time; ``delta``
bounds the chance that the seeds chosen happen to fail a correct engine.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Mapping, Sequence

import numpy as np

#: the chance a correct engine fails one frequency check (over the choice of seeds)
DELTA = 1e-6
#: the category of a request that ended on an end-of-sequence token at its first step
END = "end-of-sequence"
#: a bin is tested on its own when this many samples are expected in it
MIN_EXPECTED = 5.0
#: most bins tested on their own (the rest are pooled)
MAX_BINS = 12


@dataclass(frozen=True)
class Reference:
    """The model's next-token log-probabilities after a prompt (temperature 1, natural
    log, over the whole vocabulary), and the tokens that end a request there."""

    logprobs: np.ndarray
    end_ids: frozenset[int]


def mlx_lm_reference(model_path: str | Path, prompt: Sequence[int]) -> Reference:
    """The reference of an mlx-lm model directory: one forward of ``prompt`` in float32.
    Call it on the MLX thread."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(model_path))
    logits = model(mx.array([list(prompt)]))[0, -1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    return Reference(np.array(logprobs, dtype=np.float64), frozenset(tokenizer.eos_token_ids))


def mlx_vlm_reference(model_path: str | Path, prompt: Sequence[int]) -> Reference:
    """The reference of an mlx-vlm model directory: its own language model (mlx-vlm's
    classes, not the mlx-lm model an engine may build from the text config) on the text
    ``prompt``. Call it on the MLX thread."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model

    model = load_model(Path(model_path))
    output = model.language_model(mx.array([list(prompt)]))
    logits = getattr(output, "logits", output)[0, -1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    return Reference(np.array(logprobs, dtype=np.float64),
                     frozenset(load_tokenizer(Path(model_path)).eos_token_ids))


def filtered(logprobs: np.ndarray, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The probabilities a sampler with these settings draws from (zero where cut)."""
    scaled = logprobs / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.ones(len(probs), dtype=bool)
    order = np.argsort(-probs, kind="stable")
    if 0 < top_k < len(probs):
        keep[order[top_k:]] = False
    if 0.0 < top_p < 1.0:
        mass_above = np.concatenate(([0.0], np.cumsum(probs[order])[:-1]))
        keep[order[mass_above >= top_p]] = False
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    cut = np.where(keep, probs, 0.0)
    return cut / cut.sum()


def temperature_for(logprobs: np.ndarray, top_mass: float = 0.35) -> float:
    """A temperature at which the most likely token takes about ``top_mass`` of the
    probability (1.0 if it takes more already): low enough that sampling at the wrong
    temperature, or greedily, is told apart from the right one in a few hundred draws."""
    if filtered(logprobs).max() >= top_mass:
        return 1.0
    low, high = 1e-3, 1.0
    for _ in range(60):
        middle = math.sqrt(low * high)
        if filtered(logprobs, temperature=middle).max() > top_mass:
            low = middle
        else:
            high = middle
    return round(high, 4)


def _largest_gap(values: np.ndarray, candidates: range) -> int:
    """The ``m`` among ``candidates`` with the largest ``values[m - 1] - values[m]``."""
    return max(candidates, key=lambda m: values[m - 1] - values[m])


# The three filters keep different numbers of tokens, so an engine that applies one
# filter's cut for another's fails.


def top_k_for(logprobs: np.ndarray) -> int:
    """A ``top_k`` in 3..8 whose cut falls in the widest gap between two log-probabilities
    (so float noise between engine and reference cannot move a token across it)."""
    return _largest_gap(np.sort(logprobs)[::-1], range(3, 9))


def top_p_for(logprobs: np.ndarray) -> float:
    """A ``top_p`` that keeps 9..16 tokens, half a token's mass from either edge."""
    probs = np.sort(filtered(logprobs))[::-1]
    kept = _largest_gap(probs, range(9, 17))
    return float(probs[:kept - 1].sum() + probs[kept - 1] / 2)


def min_p_for(logprobs: np.ndarray) -> float:
    """A ``min_p`` that keeps 2 tokens or more (at most 8), midway in log space between
    the last kept and the first cut, at the widest such gap."""
    ratios = np.sort(logprobs)[::-1] - logprobs.max()
    kept = _largest_gap(ratios, range(2, 9))
    return float(math.exp((ratios[kept - 1] + ratios[kept]) / 2))


def _log_binomial_pmf(n: int, k: int, q: float) -> float:
    if q <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if q >= 1.0:
        return 0.0 if k == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(q) + (n - k) * math.log1p(-q))


def binomial_tails(n: int, k: int, q: float) -> tuple[float, float]:
    """``P(X <= k)`` and ``P(X >= k)`` for ``X ~ Binomial(n, q)``, exactly."""
    pmf = [math.exp(_log_binomial_pmf(n, i, q)) for i in range(n + 1)]
    return min(1.0, sum(pmf[:k + 1])), min(1.0, sum(pmf[k:]))


def category_probs(probs: np.ndarray, end_ids: frozenset[int]) -> dict[Hashable, float]:
    """``probs`` by what a one-token request shows: a token id, or :data:`END` for every
    end-of-sequence token together (such a request ends with no token)."""
    found: dict[Hashable, float] = {}
    for token in np.nonzero(probs)[0].tolist():
        key = END if token in end_ids else token
        found[key] = found.get(key, 0.0) + float(probs[token])
    return found


def frequency_failures(samples: Sequence[Hashable], expected: Mapping[Hashable, float],
                       delta: float = DELTA) -> list[str]:
    """Why ``samples`` do not look drawn from ``expected`` (empty when they do).

    A sample of a category ``expected`` gives no probability is a failure outright. The
    categories expected :data:`MIN_EXPECTED` times or more (at most :data:`MAX_BINS`)
    are bins of their own and the rest one pooled bin; each bin's count is tested
    two-sided against its binomial law at ``delta / (2 * bins)`` per tail, so a correct
    engine fails with probability at most ``delta``."""
    n = len(samples)
    counts = Counter(samples)
    outside = {c: k for c, k in counts.items() if expected.get(c, 0.0) <= 0.0}
    failures = []
    if outside:
        shown = ", ".join(f"{c!r} ({k}x)" for c, k in sorted(outside.items(), key=lambda i: -i[1])[:5])
        failures.append(f"{sum(outside.values())} of {n} samples are tokens the filtered "
                        f"distribution gives no probability: {shown}"
                        + (f" and {len(outside) - 5} more" if len(outside) > 5 else ""))
    ranked = sorted((c for c in expected if expected[c] > 0), key=lambda c: -expected[c])
    own = [c for c in ranked[:MAX_BINS] if n * expected[c] >= MIN_EXPECTED]
    bins: list[tuple[str, float, int]] = [(repr(c), expected[c], counts[c]) for c in own]
    pooled = [c for c in ranked if c not in own]
    if pooled:
        bins.append((f"the {len(pooled)} other categories", sum(expected[c] for c in pooled),
                     sum(counts[c] for c in pooled)))
    level = delta / (2 * len(bins))
    for name, q, count in bins:
        below, above = binomial_tails(n, count, q)
        if min(below, above) < level:
            failures.append(f"{name}: {count} of {n} samples, expected {n * q:.1f} "
                            f"(p = {q:.4f}; a correct sampler gives a count this far off "
                            f"with probability {min(below, above):.2g} < {level:.2g})")
    return failures
