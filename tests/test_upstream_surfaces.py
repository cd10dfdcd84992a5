"""What omlx-core relies on of its dependencies beyond their documented API, one test per
surface. pyproject.toml bounds these dependencies to the minor versions the suite runs;
before a bound is raised, this file says what a new release changed and what to re-check.

- waitress: ``omlx_core/http/connection_guard.py`` copies the dispatcher's worker loop and
  overrides the channel's and server's hooks around their own code (fingerprinted here:
  the source, less docstrings and comments, as read from waitress 3.0.2);
- mlx-lm's tokenizer loader: ``omlx_core/models/tokenizer_json.py`` swaps its module's
  ``json`` so that only the ``decoder`` entry of ``tokenizer.json`` is parsed;
- mlx-lm's attention and SwiGLU: ``omlx_core/models/attention.py`` and ``mlp_route.py``
  replace the functions the model families call through a module global, with the same
  parameters;
- xgrammar: ``omlx_core/grammar/torch_stub.py`` stands in for torch; what xgrammar takes
  of it must be there.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

WAITRESS_READ = "3.0.2"


def canonical(node: Any) -> str:
    """An AST as text without docstrings, comments, layout or empty fields: the same for
    the same code on every Python version the project supports."""
    if isinstance(node, list):
        return "[" + ",".join(canonical(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name, value in ast.iter_fields(node):
        if name in ("ctx", "type_comment", "kind"):
            continue
        if (name == "body" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and value and isinstance(value[0], ast.Expr)
                and isinstance(value[0].value, ast.Constant) and isinstance(value[0].value.value, str)):
            value = value[1:]
        if value is None or value == []:
            continue
        fields.append(f"{name}={canonical(value)}")
    return f"{type(node).__name__}({','.join(fields)})"


def fingerprint(qualified: str) -> str:
    parts = qualified.split(".")
    found: Any = importlib.import_module(".".join(parts[:2]))
    for part in parts[2:]:
        found = getattr(found, part)
    tree = ast.parse(textwrap.dedent(inspect.getsource(found)))
    return hashlib.sha256(canonical(tree.body[0]).encode()).hexdigest()[:16]


def test_the_fingerprint_ignores_layout_and_sees_code() -> None:
    one = ast.parse("def f(a):\n    '''doc'''\n    # why\n    return a + 1\n").body[0]
    same = ast.parse("def f(a):\n    return (a\n            + 1)\n").body[0]
    other = ast.parse("def f(a):\n    return a + 2\n").body[0]
    assert canonical(one) == canonical(same) != canonical(other)


#: what connection_guard.py relies on, its fingerprint in waitress 3.0.2, what to re-check
WAITRESS = {
    "waitress.task.ThreadedTaskDispatcher": (
        "2aca4725762e35b9",
        "ReleasingDispatcher.handler_thread is a copy of its worker loop (with the finished "
        "task dropped), and its queue_cv is replaced by IdleWorkers, which offers wait() to "
        "that loop and notify()/notify_all() to the rest: carry loop changes over and check "
        "every use of queue_cv"),
    "waitress.channel.HTTPChannel.received": (
        "3bc825df15e818f3",
        "GuardedChannel.received times a request from its first byte and takes "
        "self.request being None afterwards as 'between requests'"),
    "waitress.server.BaseWSGIServer.handle_accept": (
        "cef1947bef8ed965",
        "GuardedServer.handle_accept calls it up to ACCEPT_BURST times a turn and stops "
        "when the channel map did not grow (nothing left to accept)"),
    "waitress.server.BaseWSGIServer.maintenance": (
        "8dc45a4ba9db1e0b",
        "GuardedServer.maintenance runs the request deadlines after it, over "
        "active_channels, skipping channels marked will_close or close_when_flushed"),
    "waitress.server.BaseWSGIServer.readable": (
        "3877bb44791e90e4",
        "GuardedServer.readable evicts idle connections near connection_limit before it "
        "decides whether to accept"),
}


@pytest.mark.parametrize("qualified", sorted(WAITRESS))
def test_waitress_code_the_connection_guard_extends_is_unchanged(qualified: str) -> None:
    expected, recheck = WAITRESS[qualified]
    found = fingerprint(qualified)
    assert found == expected, (
        f"waitress {metadata.version('waitress')} changed {qualified} since waitress "
        f"{WAITRESS_READ}, which omlx_core/http/connection_guard.py was written against. "
        f"Re-check: {recheck}; then run tests/test_http_connection_guard.py and record "
        f"fingerprint {found!r} here.")


def test_mlx_lm_reads_only_the_decoder_of_tokenizer_json(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm.tokenizer_utils as tokenizer_utils

    from omlx_core.models.tokenizer_json import LazyTokenizerJson
    from omlx_core.testing import build_tokenizer

    version = metadata.version("mlx-lm")
    module = getattr(tokenizer_utils, "json", None)
    assert module is not None and hasattr(module, "load"), (
        f"mlx-lm {version}'s tokenizer_utils no longer reads tokenizer.json through a module "
        "global `json`: read_tokenizer_json (omlx_core/models/tokenizer_json.py) swaps that "
        "global so that only the decoder entry is parsed. Re-check how mlx-lm picks its "
        "streaming detokenizer; without the swap every load parses the whole file again "
        "(issue 20's resident-set growth over load/unload cycles, "
        "tests/test_model_pool_real.py)")
    asked: list[str] = []

    class Recording(LazyTokenizerJson):
        def __getitem__(self, key: str) -> Any:
            asked.append(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            asked.append(str(key))
            return super().__contains__(key)

        def __iter__(self):
            asked.append("<every key>")
            return super().__iter__()

    class Loader:
        def __getattr__(self, name: str) -> Any:
            return getattr(json, name)

        @staticmethod
        def load(file: Any, **kwargs: Any) -> Any:
            return Recording(file.read())

    monkeypatch.setattr(tokenizer_utils, "json", Loader())
    build_tokenizer(tmp_path)
    tokenizer_utils.load(tmp_path)
    assert asked and set(asked) == {"decoder"}, (
        f"mlx-lm {version}'s tokenizer loader now reads {sorted(set(asked))} of "
        "tokenizer.json, not only 'decoder': LazyTokenizerJson "
        "(omlx_core/models/tokenizer_json.py) parses the whole file for any other key, "
        "so the saving is gone. Re-check what mlx-lm reads there and whether the lazy "
        "reader should decode those entries alone too")


ATTENTION_PARAMETERS = ["queries", "keys", "values", "cache", "scale", "mask", "sinks"]
SWIGLU_PARAMETERS = ["gate", "x"]


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_mlx_lms_attention_and_swiglu_take_what_the_routes_take() -> None:
    from mlx_lm.models import activations, base

    version = metadata.version("mlx-lm")
    found = _parameters(base.scaled_dot_product_attention)
    assert found == ATTENTION_PARAMETERS, (
        f"mlx-lm {version} changed mlx_lm.models.base.scaled_dot_product_attention's "
        f"parameters from {ATTENTION_PARAMETERS} to {found}: install_cpu_attention "
        "(omlx_core/models/attention.py) puts a function of the old parameters in its "
        "place. Re-check cpu_attention's arguments and its fallback call, then run "
        "tests/test_models_attention.py")
    assert inspect.signature(base.scaled_dot_product_attention).parameters["sinks"].default is None
    found = _parameters(activations.swiglu)
    assert found == SWIGLU_PARAMETERS, (
        f"mlx-lm {version} changed mlx_lm.models.activations.swiglu's parameters from "
        f"{SWIGLU_PARAMETERS} to {found}: install_cpu_swiglu (omlx_core/models/mlp_route.py) "
        "puts a function of the old parameters in its place. Re-check cpu_swiglu and run "
        "tests/test_models_mlp_route.py")


@pytest.mark.parametrize("family,names", [
    ("llama", ("scaled_dot_product_attention", "swiglu")),
    ("qwen3", ("scaled_dot_product_attention", "swiglu")),
    ("qwen3_moe", ("scaled_dot_product_attention", "swiglu")),
    ("gemma3_text", ("scaled_dot_product_attention",)),
])
def test_model_families_call_attention_and_swiglu_through_a_module_global(family, names) -> None:
    from mlx_lm.models import activations, base

    originals = {"scaled_dot_product_attention": base.scaled_dot_product_attention,
                 "swiglu": activations.swiglu}
    marks = {"scaled_dot_product_attention": "_omlx_cpu_attention", "swiglu": "_omlx_cpu_swiglu"}
    module = importlib.import_module(f"mlx_lm.models.{family}")
    for name in names:
        current = getattr(module, name, None)
        assert current is originals[name] or getattr(current, marks[name], False), (
            f"mlx-lm {metadata.version('mlx-lm')}'s mlx_lm.models.{family} no longer calls "
            f"{name} through its module global: the CPU route (omlx_core/models/"
            f"{'attention' if name != 'swiglu' else 'mlp_route'}.py) replaces that global, so "
            f"{family} models would load and run mlx's own op, slower. Re-check "
            "family_modules in omlx_core/models/attention.py")


@pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                    reason="xgrammar is not installed (./setup.sh installs it)")
def test_xgrammar_takes_nothing_of_torch_the_stub_lacks() -> None:
    code = textwrap.dedent("""
        import json, logging, tempfile
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("omlx_core.grammar.torch_stub").addHandler(Keep())
        from omlx_core.grammar import torch_stub
        torch_stub.install()
        import xgrammar
        from transformers import AutoTokenizer
        from omlx_core.grammar import GrammarCompilerCache, GrammarConstraint, GrammarSpec
        from omlx_core.testing import build_tokenizer
        folder = tempfile.mkdtemp()
        build_tokenizer(folder)
        cache = GrammarCompilerCache(AutoTokenizer.from_pretrained(folder), vocab_size=512)
        constraint = GrammarConstraint(cache.compile(GrammarSpec.json_schema(
            {"type": "object", "properties": {"a": {"type": "integer"}}})))
        masked = constraint.fill_bitmask() is not None
        cache.close()
        print(json.dumps({"records": records, "masked": masked}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TVM_FFI_DISABLE_TORCH_C_DLPACK"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, env=env)
    version = metadata.version("xgrammar")
    assert done.returncode == 0, (
        f"xgrammar {version} fails with omlx-core's torch stub (omlx_core/grammar/"
        f"torch_stub.py) in place of torch:\n{done.stderr[-3000:]}\nRe-check what xgrammar "
        f"{version} needs of torch at import and on the bitmask path, or keep setup.sh's pin")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["records"] == [], (
        f"xgrammar {version} reached for torch names the stub does not define: "
        f"{result['records']}. Re-check what it does with them; define them in "
        "omlx_core/grammar/torch_stub.py (inert), or keep setup.sh's xgrammar pin")
    assert result["masked"]
