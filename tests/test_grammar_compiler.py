"""Compiled grammars: cached once per tokenizer, bounded in bytes, errors that name the
field, compiles in worker processes that stop at their deadline."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                reason="xgrammar is not installed (./setup.sh installs it)")

from omlx_core.grammar import (  # noqa: E402
    GrammarCompileTimeout,
    GrammarCompilerCache,
    GrammarError,
    GrammarSpec,
    compiler_for,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from mlx_lm import load

    _, tokenizer = load(str(tiny_model_path("llama")))
    return tokenizer


@pytest.fixture()
def cache(tokenizer):
    cache = GrammarCompilerCache(tokenizer, vocab_size=512)
    yield cache
    cache.close()


def test_second_compile_of_the_same_grammar_is_a_cache_hit(cache):
    cold = cache.compile(GrammarSpec.json_schema(SCHEMA))
    # The same schema written with other whitespace is the same grammar.
    warm = cache.compile(GrammarSpec.json_schema(json.dumps(SCHEMA, indent=4)))
    assert not cold.cached and warm.cached
    assert warm.grammar is cold.grammar
    assert warm.compile_seconds == cold.compile_seconds > 0
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_concurrent_askers_of_one_new_grammar_share_its_one_compile(cache):
    """Eight requests with the same new schema at once (the soak's tool and JSON chats):
    the first compiles it, the others wait for that compile and get the same grammar.
    (A second asker once found the compile running and raised: a 500.)"""
    from omlx_core.bench.client import run_concurrently

    # Raises, naming the asker, if any compile raised.
    results, _ = run_concurrently(8, lambda _: cache.compile(GrammarSpec.json_schema(SCHEMA)))
    assert len({id(result.grammar) for result in results}) == 1
    assert cache.stats.misses + cache.stats.hits == 8


def test_property_order_and_strictness_make_distinct_grammars(cache):
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    ordered = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    keys = {GrammarSpec.json_schema(reordered).key, GrammarSpec.json_schema(ordered).key,
            GrammarSpec.json_schema(ordered, strict=False).key}
    assert len(keys) == 3


def test_cache_keeps_the_most_recently_used_up_to_its_byte_budget(tokenizer, cache):
    first, second, third = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    cache.compile(first)
    one = cache.bytes
    assert one > 0
    # Room for two of them (they are the same size), not three.
    bounded = GrammarCompilerCache(tokenizer, vocab_size=512, cache_bytes=int(2.5 * one))
    bounded.compile(first)
    bounded.compile(second)
    bounded.compile(first)  # first is now the most recent
    bounded.compile(third)
    assert len(bounded) == 2 and bounded.stats.evictions == 1
    assert bounded.bytes <= bounded.cache_bytes
    assert first in bounded and third in bounded and second not in bounded
    assert not bounded.compile(second).cached
    # A grammar larger than the whole budget is compiled, used and not kept.
    tiny = GrammarCompilerCache(tokenizer, vocab_size=512, cache_bytes=one // 2)
    assert tiny.compile(first).grammar is not None and len(tiny) == 0 and tiny.bytes == 0


def test_every_kind_compiles(cache):
    for spec in (GrammarSpec.any_json(), GrammarSpec.json_schema(True), GrammarSpec.regex(r"\d{3}"),
                 GrammarSpec.ebnf('root ::= "yes" | "no"'),
                 GrammarSpec.structural_tag({"type": "structural_tag",
                                             "format": {"type": "const_string", "value": "hi"}})):
        assert cache.compile(spec).grammar is not None


@pytest.mark.parametrize("make, field, words", [
    (lambda: GrammarSpec.json_schema('{"type": "object",'), "response_format.json_schema.schema", "not valid JSON"),
    (lambda: GrammarSpec.json_schema(["type", "object"]), "response_format.json_schema.schema", "JSON Schema object"),
    (lambda: GrammarSpec.json_schema(False), "response_format.json_schema.schema", "no value satisfies"),
    (lambda: GrammarSpec.regex(""), "regex", "non-empty"),
    (lambda: GrammarSpec.ebnf("  "), "grammar", "root"),
    (lambda: GrammarSpec.structural_tag({"format": {}}), "tools", "structural_tag"),
    (lambda: GrammarSpec.json_schema(SCHEMA, max_whitespace=0), "response_format.json_schema.schema", "max_whitespace"),
])
def test_malformed_input_is_refused_before_compiling(make, field, words):
    with pytest.raises(GrammarError) as caught:
        make()
    assert caught.value.field == field and words in caught.value.message


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec.json_schema({"type": "nonsense"}, field="response_format.json_schema.schema"),
     'Unsupported type "nonsense"'),
    (GrammarSpec.regex("(abc", field="regex"), "parenthesis is not closed"),
    (GrammarSpec.ebnf("root ::= undefined_rule", field="grammar"), 'Rule "undefined_rule" is not defined'),
    (GrammarSpec.structural_tag({"type": "structural_tag", "format": {"type": "bogus"}}, field="tools"),
     "structural tag"),
])
def test_uncompilable_grammar_raises_naming_the_field(cache, spec, words):
    with pytest.raises(GrammarError) as caught:
        cache.compile(spec)
    assert caught.value.field == spec.field
    assert words in caught.value.message
    # The C++ source location xgrammar prefixes is no use to a client.
    assert ".cc:" not in caught.value.message
    assert cache.stats.errors == 1 and spec not in cache


def test_unknown_token_in_a_structural_tag_is_named(cache):
    tag = {"type": "structural_tag", "format": {"type": "token", "token": "<|not_a_token|>"}}
    with pytest.raises(GrammarError, match="<|not_a_token|>"):
        cache.compile(GrammarSpec.structural_tag(tag))


def slow_grammar() -> GrammarSpec:
    # 6000 alternatives take ~2 s to compile against the 512-token test vocabulary on
    # one core: several times the time limit below, so the deadline is certain.
    return GrammarSpec.ebnf("root ::= " + " | ".join(f'"word{i}" root?' for i in range(6000)),
                            field="grammar")


def test_a_compile_past_its_deadline_is_stopped_and_its_worker_killed(tokenizer):
    from omlx_core.grammar.compile_queue import compile_queue

    queue = compile_queue()
    cache = GrammarCompilerCache(tokenizer, vocab_size=512, compile_timeout_s=0.3)
    cache.compile(GrammarSpec.regex("warm"))  # a worker is running
    before = set(queue.worker_pids())
    killed = queue.killed
    spec = slow_grammar()
    with pytest.raises(GrammarCompileTimeout) as caught:
        cache.compile(spec)
    assert caught.value.field == "grammar" and "0.3 s" in caught.value.message
    assert "grammar.compile_timeout_s" in caught.value.message
    assert spec not in cache and cache.stats.timeouts == 1 and queue.killed == killed + 1
    # The process that ran it is gone, and what it held with it.
    gone = before - set(queue.worker_pids())
    assert len(gone) == 1 and not _alive(gone.pop())
    # The next grammar compiles in a fresh worker.
    assert cache.compile(GrammarSpec.regex("(yes|no)")).grammar is not None


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie that was reaped is gone; one that was not would still answer
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_vocab_size_is_the_logits_width_not_the_tokenizer_size(tokenizer):
    cache = GrammarCompilerCache(tokenizer, vocab_size=544)
    assert cache.vocab_size == 544 and cache.compile(GrammarSpec.any_json()).vocab_size == 544


def test_compiler_for_builds_one_cache_per_tokenizer_and_vocabulary(tokenizer):
    first = compiler_for(tokenizer, vocab_size=512)
    assert compiler_for(tokenizer, vocab_size=512) is first
    assert compiler_for(tokenizer, vocab_size=544) is not first


def test_without_xgrammar_the_error_says_how_to_install_it():
    code = (
        "import sys; sys.modules['xgrammar'] = None\n"  # the documented way to make an import fail
        "from omlx_core.grammar import GrammarUnavailable, import_xgrammar\n"
        "try:\n    import_xgrammar()\nexcept GrammarUnavailable as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install --no-deps" in done.stdout and "omlx-core[grammar]" in done.stdout


def test_a_hugging_face_tokenizer_works_as_well_as_mlx_lms_wrapper(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from omlx_core.testing import build_tokenizer, special_token_id
    from omlx_core.testing.tokenizer import IM_END

    build_tokenizer(tmp_path)
    cache = GrammarCompilerCache(AutoTokenizer.from_pretrained(tmp_path), vocab_size=512)
    try:
        assert cache.stop_token_ids == [special_token_id(IM_END)]
        assert cache.compile(GrammarSpec.regex("(yes|no)")).grammar is not None
    finally:
        cache.close()


@pytest.mark.parametrize("installed, warned", [("0.2.8", False), ("0.2.9", True), ("0.1.25", True),
                                               (None, False)])
def test_an_xgrammar_release_other_than_the_tested_one_is_warned_about(monkeypatch, caplog,
                                                                       installed, warned):
    from importlib.metadata import PackageNotFoundError

    from omlx_core.grammar import xgrammar_import

    def version(name):
        assert name == "xgrammar"
        if installed is None:
            raise PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(xgrammar_import, "version", version)
    monkeypatch.setattr(xgrammar_import, "XGRAMMAR_TESTED", "0.2.8")
    with caplog.at_level("WARNING", logger="omlx_core.grammar.xgrammar_import"):
        warning = xgrammar_import.check_xgrammar_version()
    if not warned:
        assert warning is None and not caplog.records
        return
    assert warning is not None and f"xgrammar {installed} is installed" in warning
    assert "pip install --no-deps 'xgrammar==0.2.8'" in warning
    assert [r.levelname for r in caplog.records] == ["WARNING"]
