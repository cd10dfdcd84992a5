"""The per-row constraint: masks exactly what the grammar forbids, advances and rolls
back with the tokens, and drives mlx-lm's decoding through its logits-processor protocol
without touching the rows it does not constrain."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                reason="xgrammar is not installed (./setup.sh installs it)")

import mlx.core as mx  # noqa: E402

from omlx_core.grammar import (  # noqa: E402
    GrammarCompilerCache,
    GrammarConstraint,
    GrammarSpec,
    apply_token_bitmask,
)
from omlx_core.testing import special_token_id  # noqa: E402
from omlx_core.testing.tokenizer import ENDOFTEXT, IM_END, IM_START  # noqa: E402

EOS = special_token_id(IM_END)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    from mlx_lm import load

    return load(str(tiny_model_path("llama")))


@pytest.fixture(scope="module")
def compiler(model_and_tokenizer):
    cache = GrammarCompilerCache(model_and_tokenizer[1], vocab_size=512)
    yield cache
    cache.close()


def allowed_ids(constraint: GrammarConstraint, width: int = 512) -> set[int]:
    masked = constraint.mask_logits(mx.zeros((1, width)))
    return set(np.flatnonzero(np.isfinite(np.array(masked[0]))).tolist())


@pytest.mark.parametrize("shape", [(70,), (1, 70)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_bitmask_application_matches_the_bits(shape, dtype):
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, size=(1, 3), dtype=np.int64).astype(np.int32)
    logits = mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)
    masked = np.array(apply_token_bitmask(logits, bitmask).astype(mx.float32)).reshape(-1)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:70].astype(bool)
    original = np.array(logits.astype(mx.float32)).reshape(-1)
    assert np.array_equal(np.isneginf(masked), ~bits)
    assert np.array_equal(masked[bits], original[bits])


def test_bitmask_narrower_than_the_logits_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        apply_token_bitmask(mx.zeros((1, 100)), np.full((1, 2), -1, dtype=np.int32))


def test_accept_mask_rollback_and_termination(model_and_tokenizer, compiler):
    tokenizer = model_and_tokenizer[1]
    constraint = GrammarConstraint(compiler.compile(GrammarSpec.regex("(yes|no)")))
    first = allowed_ids(constraint)
    decoded = {i: tokenizer.decode([i]) for i in first}
    assert decoded and all("yes".startswith(t) or "no".startswith(t) for t in decoded.values())

    yes = tokenizer.encode("yes")
    assert constraint.accept_tokens(yes) == len(yes)
    assert constraint.is_completed() and not constraint.is_terminated()
    assert allowed_ids(constraint) == {EOS}

    constraint.rollback(len(yes))
    assert allowed_ids(constraint) == first and constraint.num_accepted == 0
    with pytest.raises(ValueError, match="cannot roll back 1 tokens"):
        constraint.rollback(1)

    no = tokenizer.encode("no")
    assert not constraint.accept(tokenizer.encode("x")[0])  # refused, state unchanged
    assert constraint.accept_tokens(no) == len(no) and constraint.accept(EOS)
    assert constraint.is_terminated()
    assert allowed_ids(constraint) == {EOS}  # after the end only a stop token fits
    constraint.reset()
    assert allowed_ids(constraint) == first and not constraint.is_terminated()


def test_control_tokens_never_appear_in_free_text(compiler):
    constraint = GrammarConstraint(compiler.compile(GrammarSpec.structural_tag(
        {"type": "structural_tag", "format": {"type": "any_text"}})))
    allowed = allowed_ids(constraint)
    assert special_token_id(IM_START) not in allowed and special_token_id(ENDOFTEXT) not in allowed
    assert EOS in allowed and len(allowed) > 400


def test_padded_logits_beyond_the_tokenizer_are_never_allowed(model_and_tokenizer):
    cache = GrammarCompilerCache(model_and_tokenizer[1], vocab_size=544)
    try:
        constraint = GrammarConstraint(cache.compile(GrammarSpec.any_json()))
        assert max(allowed_ids(constraint, width=544)) < 512
    finally:
        cache.close()


def test_processor_follows_mlx_lm_generate_step(model_and_tokenizer, compiler):
    """mlx-lm's own decode loop, with the processor as its only constraint."""
    from mlx_lm.generate import generate_step

    model, tokenizer = model_and_tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraint = GrammarConstraint(compiler.compile(GrammarSpec.json_schema(schema)))
    prompt = mx.array(tokenizer.encode("The answer, as JSON:"))
    tokens = []
    for token, _ in generate_step(prompt, model, max_tokens=120,
                                  logits_processors=[constraint.processor()]):
        if token == EOS:
            break
        tokens.append(token)
    assert json.loads(tokenizer.decode(tokens)).keys() == {"ok"}
    assert constraint.is_completed()


def test_processor_rolls_back_when_the_context_shrinks(model_and_tokenizer, compiler):
    tokenizer = model_and_tokenizer[1]
    constraint = GrammarConstraint(compiler.compile(GrammarSpec.regex("[a-z]+!")))
    processor = constraint.processor()
    prompt = tokenizer.encode("hi")
    processor(mx.array(prompt), mx.zeros((1, 512)))
    drafted = tokenizer.encode("abc")
    processor(mx.array(prompt + drafted), mx.zeros((1, 512)))
    assert constraint.num_accepted == len(drafted)
    # A verifier kept only the first drafted token.
    processor(mx.array(prompt + drafted[:1]), mx.zeros((1, 512)))
    assert constraint.num_accepted == 1


def test_a_token_the_mask_forbade_ends_the_row(model_and_tokenizer, compiler):
    tokenizer = model_and_tokenizer[1]
    constraint = GrammarConstraint(compiler.compile(GrammarSpec.regex("[0-9]+")))
    processor = constraint.processor()
    prompt = tokenizer.encode("n=")
    processor(mx.array(prompt), mx.zeros((1, 512)))
    masked = processor(mx.array(prompt + tokenizer.encode("x")), mx.zeros((1, 512)))
    assert processor.violations == 1
    assert set(np.flatnonzero(np.isfinite(np.array(masked[0]))).tolist()) == {EOS}


def run_batch(model, prompts, processors):
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=128, stop_tokens=[[EOS]])
    try:
        uids = generator.insert(prompts, logits_processors=processors)
        outputs = {uid: [] for uid in uids}
        finished: set[int] = set()
        while len(finished) < len(uids):
            for response in generator.next_generated():
                if response.finish_reason is None or response.token != EOS:
                    outputs[response.uid].append(response.token)
                if response.finish_reason is not None:
                    finished.add(response.uid)
        return [outputs[uid] for uid in uids]
    finally:
        generator.close()


@pytest.mark.slow
def test_constrained_rows_leave_the_other_rows_of_a_batch_unchanged(model_and_tokenizer, compiler):
    """16 rows through mlx-lm's BatchGenerator, 8 constrained by 8 different schemas: the
    other 8 decode greedily exactly as in a batch where nothing is constrained."""
    import jsonschema

    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer.encode(f"Request {i}: tell me about the weather in city {i}.") for i in range(16)]
    schemas = [{"type": "object", "properties": {f"field{i}": {"type": "integer", "minimum": 0, "maximum": 10 ** i}},
                "required": [f"field{i}"]} for i in range(8)]
    baseline = run_batch(model, prompts, [[] for _ in prompts])
    assert all(len(tokens) > 8 for tokens in baseline), "the comparison needs rows that decode a while"

    constraints = {2 * i: GrammarConstraint(compiler.compile(GrammarSpec.json_schema(schemas[i])))
                   for i in range(8)}
    processors = [[constraints[row].processor()] if row in constraints else [] for row in range(16)]
    mixed = run_batch(model, prompts, processors)

    for row in range(16):
        if row in constraints:
            value = json.loads(tokenizer.decode(mixed[row]))
            jsonschema.validate(value, schemas[row // 2])
        else:
            assert mixed[row] == baseline[row], f"unconstrained row {row} changed"


@pytest.mark.parametrize("lead, bad, good", [
    (0xED, (0xA0, 0xBF), (0x80, 0x9F)),  # UTF-16 surrogates
    (0xE0, (0x80, 0x9F), (0xA0, 0xBF)),  # overlong 3-byte forms
    (0xF0, (0x80, 0x8F), (0x90, 0xBF)),  # overlong 4-byte forms
    (0xF4, (0x90, 0xBF), (0x80, 0x8F)),  # past U+10FFFF
])
def test_masks_never_spell_invalid_utf8(compiler, lead, bad, good):
    """xgrammar admits some invalid UTF-8 in strings (a random model emitted ED A0 .. and
    F0 87 .., which decoded to replacement characters and broke a maxLength). After a
    token ending in a lead byte the mask forbids the second bytes that make it invalid."""
    vocab = list(compiler.tokenizer_info.decoded_vocab)
    byte_token = {raw[0]: i for i, raw in enumerate(vocab) if len(raw) == 1}
    constraint = GrammarConstraint(compiler.compile(GrammarSpec.json_schema({"type": "string"})))
    assert constraint.accept(byte_token[ord('"')]) and constraint.accept(byte_token[lead])
    allowed = allowed_ids(constraint)
    assert {byte_token[b] for b in good} <= allowed
    assert not {byte_token[b] for b in bad} & allowed


def test_mask_batch_masks_each_constrained_row_and_leaves_the_others_bit_for_bit(model_and_tokenizer, compiler):
    from omlx_core.grammar import mask_batch

    tokenizer = model_and_tokenizer[1]
    constraints = [GrammarConstraint(compiler.compile(GrammarSpec.regex("(yes|no)"))), None,
                   GrammarConstraint(compiler.compile(GrammarSpec.json_schema({"type": "integer"}))), None]
    constraints[2].accept_tokens(tokenizer.encode("4"))
    logits = mx.random.normal((4, 512), key=mx.random.key(3))
    masked = mask_batch(logits, constraints)
    for row, constraint in enumerate(constraints):
        if constraint is None:
            assert np.array_equal(np.array(masked[row]), np.array(logits[row]))
        else:
            alone = constraint.mask_logits(logits[row:row + 1])
            assert np.array_equal(np.array(masked[row:row + 1]), np.array(alone))
            assert np.isneginf(np.array(masked[row])).sum() > 0
    assert mask_batch(logits, [None] * 4) is logits
    with pytest.raises(ValueError, match="3 constraints for 4 rows"):
        mask_batch(logits, constraints[:3])
