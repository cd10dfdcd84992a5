"""The dflash engine on tiny random models: greedy output is exactly the target's own,
for every drafter and for a dense (llama) and a hybrid (qwen3_next, ArraysCache) target;
seeded sampling is reproducible and distributed as the target's; requests the primary
path cannot take go to the batched fallback over the same weights."""

from __future__ import annotations

import itertools
from typing import Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from omlx_core.config import load_config
from omlx_core.engine import GenerationRequest, SamplingParams
from omlx_core.mlx_thread import mlx_thread
from omlx_core.models.errors import ModelError
from omlx_core.models.loader import load_model
from omlx_core.models.registry import spec_for_path
from omlx_core.plugins.dflash import DFlashEngine
from omlx_core.scheduling.acceptance import KeyStream, accept_greedy, accept_sampled, target_log_probs
from omlx_core.scheduling.drafters import Draft, Drafter, NgramDrafter, best_draft_length
from omlx_core.plugins.dflash.drafters import ModelDrafter
from omlx_core.testing.conformance import EngineConformance
from omlx_core.testing.host import make_test_host
from omlx_core.testing.models import build_model
from omlx_core.testing import engine_io
from omlx_core.testing.waiting import wait_for

FAMILIES = ("llama", "qwen3_next")
_ids = itertools.count()
#: a prompt with repeats, so prompt lookup finds matches; long enough for several chunks
PROMPT = [(i * 7) % 50 + 10 for i in range(40)] + [11, 12, 13, 11, 12]


def make_config(**overrides):
    values = {"plugin.batched.prefill_step_size": 16, **overrides}
    return load_config("base", overrides=[(k, str(v), "test") for k, v in values.items()], env={})


def start(path, drafter: Drafter | None = None, **overrides) -> DFlashEngine:
    engine = DFlashEngine(spec_for_path(path), make_test_host(make_config(**overrides)), drafter=drafter)
    engine.start()
    return engine


def generate(engine, prompt, sampling):
    handle = engine.submit(GenerationRequest(f"req-{next(_ids)}", list(prompt), sampling))
    tokens, last = [], None
    for output in engine_io.collect(handle):
        tokens += output.token_ids
        last = output
    return tokens, last


def reference_greedy(path, prompt, max_tokens) -> list[int]:
    """The target's own greedy output (mlx-lm's generate_step), eos excluded."""

    def run():
        model, tokenizer = load_model(path)
        out = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                      sampler=lambda logits: mx.argmax(logits, axis=-1)):
            if int(token) in tokenizer.eos_token_ids:
                break
            out.append(int(token))
        return out

    return mlx_thread().run(run)


class ScriptedDrafter(Drafter):
    """Proposes the target's true continuation for ``right`` tokens, then a wrong one:
    every cycle accepts exactly ``right`` drafts and rolls back the rest."""

    name = "scripted"

    def __init__(self, truth: Sequence[int], prompt_length: int, right: int, block_size: int = 8):
        self.truth = list(truth)
        self.prompt_length = prompt_length
        self.right = right
        self.block_size = block_size

    def propose(self, state, history, limit, sampling, keys):
        done = len(history) - self.prompt_length
        good = self.truth[done:done + min(self.right, limit)]
        wrong = [(t + 1) % 500 for t in self.truth[done + len(good):done + len(good) + 1]]
        return Draft((good + wrong)[:limit])


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-targets")
    return {family: build_model(family, root / family, seed=3) for family in FAMILIES}


@pytest.fixture(scope="module")
def draft_llama(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("dflash-draft") / "llama", seed=11,
                       overrides={"num_hidden_layers": 1})


@pytest.fixture(scope="module")
def references(targets):
    return {family: reference_greedy(path, PROMPT, 40) for family, path in targets.items()}


GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_output_is_the_targets_own(targets, references, family):
    engine = start(targets[family])
    try:
        tokens, last = generate(engine, PROMPT, GREEDY)
        assert tokens == references[family]
        assert last.usage.draft_tokens > 0, "prompt lookup drafted nothing on a repetitive prompt"
        assert engine.stats()["speculative"]["requests"] == 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("right", [0, 2, 5])
def test_partial_acceptance_rolls_the_cache_back_exactly(targets, references, family, right):
    truth = references[family]
    engine = start(targets[family], ScriptedDrafter(truth, len(PROMPT), right))
    try:
        tokens, last = generate(engine, PROMPT, GREEDY)
        assert tokens == truth
        usage = last.usage
        assert usage.accepted_draft_tokens >= right * (len(truth) // (right + 1) - 1)
        assert usage.accepted_draft_tokens < usage.draft_tokens
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_model_drafter_greedy_output_is_the_targets_own(targets, references, draft_llama, family):
    # A random draft accepts little; the target as its own draft accepts everything.
    for draft_path, accepts_all in ((draft_llama, False), (targets["llama"], family == "llama")):
        engine = start(targets[family], ModelDrafter(draft_path, block_size=4))
        try:
            tokens, last = generate(engine, PROMPT, GREEDY)
            assert tokens == references[family]
            assert last.usage.draft_tokens > 0
            if accepts_all:
                assert last.usage.accepted_draft_tokens == last.usage.draft_tokens
        finally:
            engine.shutdown()


def test_model_drafter_with_another_vocabulary_is_refused(targets, tmp_path):
    other = build_model("llama", tmp_path / "wide", seed=1, overrides={"vocab_size": 640})
    engine = DFlashEngine(spec_for_path(targets["llama"]), make_test_host(make_config()),
                          drafter=ModelDrafter(other))
    with pytest.raises(ModelError, match="vocabulary"):
        engine.start()


def test_unknown_drafter_and_missing_draft_path_are_named(targets):
    with pytest.raises(ModelError, match="draft_path"):
        DFlashEngine(spec_for_path(targets["llama"]), make_test_host(make_config(**{"plugin.dflash.drafter": "model"})))


def test_ngram_drafter_proposes_the_latest_continuation_of_the_longest_match():
    drafter = NgramDrafter(block_size=8, ngram_min=1, ngram_max=3, token_cost=0.0)
    history = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    state = drafter.begin(history)
    # the 2-gram (2, 3) last continued with 4, 5, ...; the 3-gram (7, 2, 3) never occurred
    assert drafter.propose(state, history, 3, GREEDY, None).tokens == [4, 5, 7]
    assert drafter.propose(state, history + [8], 3, GREEDY, None).tokens == []


def test_draft_length_follows_acceptance_and_verify_cost():
    assert best_draft_length(0.9, 7, 0.1) == 7
    assert 1 <= best_draft_length(0.5, 7, 0.1) < 7
    assert best_draft_length(0.05, 7, 0.1) == 0  # drafts that miss are not worth a wider forward
    assert best_draft_length(0.5, 7, 2.0) == 0


def test_ngram_drafter_stops_drafting_where_drafts_miss_and_tries_again_later():
    drafter = NgramDrafter(block_size=8, ngram_min=1, ngram_max=1)
    history = [1, 2, 3, 1, 2, 3, 1]
    state = drafter.begin(history)
    proposals = []
    for _ in range(40):
        draft = drafter.propose(state, history, 7, GREEDY, None)
        proposals.append(len(draft.tokens))
        # every draft is rejected at its first token
        drafter.commit(state, [history[-1]] + draft.tokens, 1, None)
    assert proposals[0] > 0
    assert 0 in proposals  # it stopped
    stopped = proposals.index(0)
    assert any(proposals[stopped:]), "it never tried again"


def test_seeded_sampling_is_reproducible_and_seeds_differ(targets):
    engine = start(targets["llama"])
    try:
        runs = [generate(engine, PROMPT, SamplingParams(temperature=0.9, top_k=50, seed=seed,
                                                        max_tokens=24))[0]
                for seed in (5, 5, 6)]
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]
    finally:
        engine.shutdown()


def test_rejection_sampling_keeps_the_targets_distribution(targets):
    """Over many draws, the first emitted token of a verify whose draft is fixed (prompt
    lookup, a point mass) or sampled from another distribution follows the target's law."""
    def draw_and_compare():
        model, _ = load_model(targets["llama"])
        logits = model(mx.array(PROMPT)[None])[0, -2:].astype(mx.float32) * 6.0
        sampling = SamplingParams(temperature=1.0, top_k=8)
        p = np.array(mx.exp(target_log_probs(logits, sampling))[0])
        likely = int(np.argmax(p))
        draft_q = mx.log(mx.softmax(mx.random.normal((1, logits.shape[-1]), key=mx.random.key(1)) * 3))
        draws = 2500
        # the likeliest token, and one outside top_k (always rejected), as point masses
        for drafts, log_q in (([likely], None), ([int(np.argsort(p)[0])], None)):
            counts = np.zeros_like(p)
            keys = KeyStream(1234)
            for _ in range(draws):
                verdict = accept_sampled(logits, drafts, sampling, keys, log_q)
                counts[verdict.tokens[0]] += 1
            total_variation = 0.5 * np.abs(counts / draws - p).sum()
            assert total_variation < 0.04, (drafts, total_variation)
        # a sampled draft: draw it from q, then accept or reject
        counts = np.zeros_like(p)
        keys = KeyStream(99)
        for i in range(draws):
            token = int(mx.random.categorical(draft_q[0], key=mx.random.key(10_000 + i)).item())
            verdict = accept_sampled(logits, [token], sampling, keys, draft_q)
            counts[verdict.tokens[0]] += 1
        assert 0.5 * np.abs(counts / draws - p).sum() < 0.04

    mlx_thread().run(draw_and_compare)


def test_greedy_acceptance_takes_the_longest_agreeing_prefix():
    logits = mx.eye(6)[mx.array([1, 2, 3, 4])] * 5
    assert accept_greedy(logits, [1, 2, 9]).tokens == (1, 2, 3)
    assert accept_greedy(logits, [1, 2, 3]).tokens == (1, 2, 3, 4)
    assert accept_greedy(logits[:1], []).tokens == (1,)


def test_busy_primary_path_and_unsupported_options_go_to_the_fallback(targets, references):
    engine = start(targets["llama"])
    try:
        first = engine.submit(GenerationRequest("first", PROMPT, GREEDY))
        second = engine.submit(GenerationRequest("second", PROMPT, GREEDY))
        outputs = {}
        for name, handle in (("first", first), ("second", second)):
            tokens = []
            for output in engine_io.collect(handle):
                tokens += output.token_ids
            outputs[name] = tokens
        # Both paths give the target's greedy output.
        assert outputs["first"] == outputs["second"] == references["llama"]
        penalized, last = generate(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                                  repetition_penalty=1.3))
        assert last.usage.draft_tokens == 0
        stats = engine.stats()["speculative"]
        assert stats["requests"] == 1 and stats["fallback_requests"] == 2
        # Idle again: a lone request goes speculative.
        generate(engine, PROMPT, GREEDY)
        assert engine.stats()["speculative"]["requests"] == 2
    finally:
        engine.shutdown()


def test_abort_on_the_primary_path_frees_it(targets):
    engine = start(targets["llama"])
    try:
        handle = engine.submit(GenerationRequest("gone", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=2000)))
        engine_io.first_output(handle)
        handle.close()
        # The abort is taken within one step.
        assert wait_for(lambda: not engine.primary.busy, 60), "the primary path stayed busy"
        tokens, last = generate(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
        assert last.finish_reason == "length"
        assert engine.stats()["speculative"]["requests"] == 2
    finally:
        engine.shutdown()


class TestDFlashEngine(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        engine = DFlashEngine(spec_for_path(tiny_model_path("llama")), make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()


class TestDFlashEngineHybrid(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, tiny_model_path):
        engine = DFlashEngine(spec_for_path(tiny_model_path("qwen3_next")),
                              make_test_host("cpu-small"))
        engine.start()
        yield engine
        engine.shutdown()


# -- the DFlash block-diffusion drafter (z-lab's dflash.model_mlx) -----------------------------


def build_dflash_draft(out_dir, target_dir, layer_ids, *, seed=0, block_size=4):
    """A random-weight DFlash draft for the tiny target at ``target_dir``, saved the way
    DFlash drafts are published (``config.json`` with ``dflash_config``, safetensors)."""
    import json

    from dflash.model_mlx import DFlashConfig, DFlashDraftModel
    from mlx.utils import tree_flatten

    target = json.loads((target_dir / "config.json").read_text())
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target["hidden_size"],
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": target["vocab_size"],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"block_size": block_size, "target_layer_ids": list(layer_ids),
                          "mask_token_id": 3},
    }
    config = DFlashConfig(
        hidden_size=raw["hidden_size"], num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=raw["vocab_size"],
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        block_size=block_size, target_layer_ids=tuple(layer_ids),
        num_target_layers=raw["num_target_layers"], mask_token_id=3)
    mx.random.seed(seed)
    model = DFlashDraftModel(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out_dir / "config.json").write_text(json.dumps(raw))
    return out_dir


DFLASH_LAYERS = {"llama": (0, 1), "qwen3_next": (1, 3)}


@pytest.mark.parametrize("family", FAMILIES)
def test_dflash_drafter_greedy_output_is_the_targets_own(targets, references, tmp_path, family):
    from omlx_core.plugins.dflash.block_diffusion import DFlashDrafter

    draft_dir = mlx_thread().run(build_dflash_draft, tmp_path / "draft", targets[family],
                                 DFLASH_LAYERS[family])
    engine = start(targets[family], DFlashDrafter(draft_dir))
    try:
        tokens, last = generate(engine, PROMPT, GREEDY)
        assert tokens == references[family]
        # one block forward per cycle: block_size - 1 drafts each (fewer near max_tokens)
        assert last.usage.draft_tokens >= 3 * (len(tokens) // 4)
        sampled = [generate(engine, PROMPT, SamplingParams(temperature=0.8, seed=7, max_tokens=16))[0]
                   for _ in range(2)]
        assert sampled[0] == sampled[1]
    finally:
        engine.shutdown()


def test_dflash_draft_for_another_model_is_refused(targets, tmp_path):
    from omlx_core.plugins.dflash.block_diffusion import DFlashDrafter

    draft_dir = mlx_thread().run(build_dflash_draft, tmp_path / "draft", targets["llama"], (0, 5))
    engine = DFlashEngine(spec_for_path(targets["llama"]), make_test_host(make_config()),
                          drafter=DFlashDrafter(draft_dir))
    with pytest.raises(ModelError, match="target layers"):
        engine.start()


def test_the_drafter_is_chosen_per_model_in_toml(targets, draft_llama, tmp_path):
    from omlx_core.bootstrap import load_setup, start_engines, stop_engines

    config = tmp_path / "omlx.toml"
    config.write_text(
        '[server]\nmodels = ["drafted", "lookup"]\n\n'
        f'[models.drafted]\npath = "{targets["llama"]}"\nengine = "dflash"\n'
        f'drafter = "model"\ndraft_path = "{draft_llama}"\n\n'
        f'[models.lookup]\npath = "{targets["llama"]}"\nengine = "dflash"\n')
    context = start_engines(load_setup("cpu-small", [config]), progress=False)
    try:
        assert context.engines["drafted"].drafter.name == "model"
        assert context.engines["lookup"].drafter.name == "ngram"
    finally:
        stop_engines(context)
    config.write_text(f'[models.bad]\npath = "{targets["llama"]}"\nengine = "dflash"\n'
                      'drafter = "medusa"\n')
    with pytest.raises(ModelError, match="unknown drafter 'medusa'"):
        start_engines(load_setup("cpu-small", [config]), ["bad"], progress=False)


def test_a_model_whose_cache_cannot_roll_back_is_served_by_the_fallback(tmp_path):
    # gemma3's sliding-window layers keep a rotating cache that cannot be cut back.
    path = build_model("gemma3", tmp_path / "gemma3", seed=1)
    engine = start(path)
    try:
        assert "RotatingKVCache" in engine.speculation_off
        tokens, last = generate(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
        assert tokens == reference_greedy(path, PROMPT, 12)
        assert engine.stats()["speculative"]["fallback_requests"] == 1
    finally:
        engine.shutdown()


def test_omlx_core_plugins_lists_the_dflash_engine_as_guarded():
    import json
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "omlx_core", "plugins", "--json", "--tier",
                             "cpu-small"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMLX_NO_BLAS_REEXEC": "1"})
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    assert listed["dflash"]["source"] == "built-in" and listed["dflash"]["status"] == "loaded"
    assert listed["dflash"]["engines"] == {"dflash": "guarded"}
    assert {"resolve_scheduler", "estimate_peak"} <= set(listed["dflash"]["hooks"])


class BrokenDrafter(NgramDrafter):
    """Fails on its first request only."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def begin(self, prompt):
        if not self.failed:
            self.failed = True
            raise RuntimeError("draft state could not be built")
        return super().begin(prompt)


def test_a_drafter_failure_ends_that_request_and_frees_the_primary_path(targets, references):
    engine = start(targets["llama"], BrokenDrafter())
    try:
        tokens, last = generate(engine, PROMPT, GREEDY)
        assert last.finish_reason == "error" and last.error_type == "internal"
        assert "draft state could not be built" in last.error
        tokens, last = generate(engine, PROMPT, GREEDY)
        assert tokens == references["llama"]
        assert engine.stats()["speculative"]["fallback_requests"] == 0
    finally:
        engine.shutdown()
