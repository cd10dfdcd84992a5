"""The torch stub lets xgrammar import without torch and steps aside for a real torch.

Each case runs in a fresh interpreter: the stub changes ``sys.modules`` and the
environment, which must start clean for every claim. The "real torch" cases put an
importable ``torch`` package of our own on ``sys.path`` instead of installing PyTorch
(a CPU wheel is hundreds of MB, too heavy for CI): what ``install()`` must detect is an
importable torch that is not the stub, whatever its contents.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Located, not imported: importing xgrammar here, without the stub, would fail for lack of torch.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                reason="xgrammar is not installed (./setup.sh installs it)")


def run_python(code: str, *, extra_path: Path | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned parsed."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_FFI_DISABLE_TORCH_C_DLPACK"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_torch_the_stub_makes_xgrammar_import():
    result = run_python("""
        import importlib.util, json, os, sys
        assert importlib.util.find_spec("torch") is None, "this test needs an environment without torch"
        from omlx_core.grammar import torch_stub
        installed = torch_stub.install()
        import xgrammar, torch
        print(json.dumps({
            "installed": installed,
            "is_stub": torch_stub.is_stub(torch),
            "env": os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK"),
            "compiler": hasattr(xgrammar, "GrammarCompiler"),
        }))
    """)
    assert result == {"installed": True, "is_stub": True, "env": "1", "compiler": True}


def test_install_is_idempotent_and_thread_safe():
    result = run_python("""
        import json, sys, threading
        from omlx_core.grammar import torch_stub
        results, modules = [], []
        barrier = threading.Barrier(8)
        def racer():
            barrier.wait()
            results.append(torch_stub.install())
            modules.append(id(sys.modules["torch"]))
        threads = [threading.Thread(target=racer) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        again = torch_stub.install()
        print(json.dumps({"results": results, "distinct_modules": len(set(modules)),
                          "again": again, "same": id(sys.modules["torch"]) == modules[0]}))
    """)
    assert result == {"results": [True] * 8, "distinct_modules": 1, "again": True, "same": True}


def test_every_stubbed_module_has_a_real_module_spec():
    result = run_python("""
        import importlib.machinery, importlib.util, json, sys
        from omlx_core.grammar import torch_stub
        torch_stub.install()
        stubbed = {n: m for n, m in sys.modules.items() if n == "torch" or n.startswith("torch.")}
        bad = [n for n, m in stubbed.items()
               if not isinstance(m.__spec__, importlib.machinery.ModuleSpec) or m.__spec__.name != n]
        # find_spec raises ValueError for a module in sys.modules whose __spec__ is None.
        found = [importlib.util.find_spec(n) is not None for n in stubbed]
        print(json.dumps({"names": sorted(stubbed), "bad": bad, "found": all(found)}))
    """)
    assert {"torch", "torch.cuda", "torch.version", "torch.nn", "torch.utils.dlpack"} <= set(result["names"])
    assert result["bad"] == [] and result["found"]


def test_stub_surface_behaves_like_torch_for_xgrammar_and_refuses_real_work():
    result = run_python("""
        import json
        import numpy as np
        from omlx_core.grammar import torch_stub
        torch_stub.install()
        import torch
        table = {torch.int32: "i32", torch.float32: "f32"}
        def raises(call, kind):
            try:
                call()
            except kind as exc:
                return str(exc)
            return None
        print(json.dumps({
            "dict_keyed": table[torch.int] == "i32" and table[torch.float] == "f32",
            "dtype_isinstance": isinstance(torch.bfloat16, torch.dtype),
            "tensor_isinstance": isinstance(np.zeros(3), torch.Tensor),
            "cuda": torch.cuda.is_available(),
            "full": raises(lambda: torch.full((1, 2), -1), torch_stub.TorchNotInstalled),
            "to_dlpack": raises(lambda: torch.utils.dlpack.to_dlpack(None), torch_stub.TorchNotInstalled),
            "no_version": not hasattr(torch, "__version__"),
        }))
    """)
    assert result["dict_keyed"] and result["dtype_isinstance"]
    assert result["tensor_isinstance"] is False and result["cuda"] is False
    assert "pip install torch" in result["full"] and "pip install torch" in result["to_dlpack"]
    assert result["no_version"]


def test_unknown_attribute_raises_and_warns_once_per_name():
    result = run_python("""
        import json, logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("omlx_core.grammar.torch_stub").addHandler(Keep())
        from omlx_core.grammar import torch_stub
        torch_stub.install()
        import torch
        errors = 0
        for name in ("frobnicate", "frobnicate", "quantize"):
            try:
                getattr(torch, name)
            except AttributeError:
                errors += 1
        hasattr(torch, "__wrapped__")  # dunder probes are routine and stay silent
        print(json.dumps({"errors": errors, "records": records}))
    """)
    assert result["errors"] == 3
    assert len(result["records"]) == 2
    assert "torch.frobnicate" in result["records"][0] and "torch.quantize" in result["records"][1]


def test_transformers_judges_the_stub_as_no_torch():
    result = run_python("""
        import json
        from omlx_core.grammar import torch_stub
        torch_stub.install()
        import xgrammar
        from transformers.utils import is_torch_available
        print(json.dumps({"available": is_torch_available()}))
    """)
    assert result == {"available": False}


def _fake_torch(root: Path, body: str) -> Path:
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return root


def test_with_an_importable_torch_install_is_a_no_op(tmp_path):
    path = _fake_torch(tmp_path, """
        __version__ = "2.13.0+cpu"
        REAL = True
    """)
    result = run_python("""
        import json, os, sys
        from omlx_core.grammar import torch_stub
        installed = torch_stub.install()
        import torch
        print(json.dumps({"installed": installed, "real": getattr(torch, "REAL", False),
                          "is_stub": torch_stub.is_stub(sys.modules["torch"]),
                          "env": os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK")}))
    """, extra_path=path)
    assert result == {"installed": False, "real": True, "is_stub": False, "env": None}


def test_an_already_imported_torch_is_left_alone(tmp_path):
    path = _fake_torch(tmp_path, "REAL = True\n")
    result = run_python("""
        import json, sys
        import torch
        from omlx_core.grammar import torch_stub
        installed = torch_stub.install()
        print(json.dumps({"installed": installed, "same": sys.modules["torch"] is torch}))
    """, extra_path=path)
    assert result == {"installed": False, "same": True}


def test_a_torch_that_fails_to_import_is_replaced_by_the_stub(tmp_path):
    path = _fake_torch(tmp_path, 'raise OSError("libcudart.so.12: cannot open shared object file")\n')
    result = run_python("""
        import json, os
        from omlx_core.grammar import torch_stub
        installed = torch_stub.install()
        import xgrammar, torch
        print(json.dumps({"installed": installed, "is_stub": torch_stub.is_stub(torch),
                          "env": os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK")}))
    """, extra_path=path)
    assert result == {"installed": True, "is_stub": True, "env": "1"}


def test_importing_omlx_grammar_imports_neither_xgrammar_nor_torch():
    result = run_python("""
        import json, sys
        import omlx_core.grammar, omlx_core.grammar.toolcalls
        print(json.dumps({"loaded": sorted(n for n in ("xgrammar", "torch", "tvm_ffi") if n in sys.modules)}))
    """)
    assert result == {"loaded": []}


REAL_TORCH = "torch==2.13.0"  # a CPU build on the project's machines (see DESIGN.md)


@pytest.fixture(scope="session")
def real_torch_path(tmp_path_factory) -> Path:
    """A real PyTorch installed into a private directory (not the test environment, whose
    other tests need torch absent): ~190 MB download, ~15 s to unpack."""
    target = tmp_path_factory.mktemp("real-torch")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--no-deps", "--target", str(target), REAL_TORCH],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.skip(f"cannot install {REAL_TORCH} here: {done.stderr.strip()[-300:]}")
    return target


@pytest.mark.slow
def test_with_real_torch_the_stub_steps_aside_and_constraints_still_work(real_torch_path):
    result = run_python("""
        import json, os, sys, tempfile
        from omlx_core.grammar import torch_stub
        installed = torch_stub.install()
        import torch
        from omlx_core.testing import build_tokenizer
        from transformers import AutoTokenizer
        from omlx_core.grammar import GrammarCompilerCache, GrammarConstraint, GrammarSpec
        folder = tempfile.mkdtemp()
        build_tokenizer(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        cache = GrammarCompilerCache(tokenizer, vocab_size=512)
        constraint = GrammarConstraint(cache.compile(GrammarSpec.regex("(yes|no)")))
        bitmask = constraint.fill_bitmask()
        accepted = constraint.accept_tokens(tokenizer.encode("yes"))
        cache.close()
        print(json.dumps({"installed": installed, "version": torch.__version__,
                          "is_stub": torch_stub.is_stub(torch),
                          "env": os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK"),
                          "masked": bitmask is not None, "accepted": accepted,
                          "completed": constraint.is_completed()}))
    """, extra_path=real_torch_path)
    assert result["version"].startswith("2.13.0")
    assert (result["installed"], result["is_stub"], result["env"]) == (False, False, None)
    assert result["masked"] and result["accepted"] >= 1 and result["completed"]
