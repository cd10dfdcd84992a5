"""Every hook is documented in the fixed template: summary, each parameter, returns,
and firstresult stated exactly when the hook is firstresult."""

from __future__ import annotations

import inspect

import pytest

from omlx_core.hookspecs import PROJECT_NAME
from omlx_core.hookspecs import specs
from omlx_core.pluginmanager import hook_names

REQUIRED_HOOKS = {"preflight", "estimate_peak", "resolve_scheduler", "on_boundary_snapshot",
                  "on_rejection", "register_engines", "register_caches", "startup", "shutdown"}


def test_product_hooks_exist():
    assert REQUIRED_HOOKS <= set(hook_names())


@pytest.mark.parametrize("name", hook_names())
def test_hook_is_documented(name):
    function = getattr(specs, name)
    options = getattr(function, f"{PROJECT_NAME}_spec")
    doc = inspect.getdoc(function)
    assert doc, f"hook {name} has no docstring"
    summary, _, body = doc.partition("\n")
    assert summary.endswith("."), f"hook {name}: the first line is a one-line summary ending in '.'"
    for param in inspect.signature(function).parameters:
        assert f":param {param}:" in body, f"hook {name}: parameter {param!r} is not documented"
    assert ":returns:" in body, f"hook {name}: the return value is not documented"
    says_firstresult = "firstresult" in body
    assert says_firstresult == bool(options.get("firstresult")), (
        f"hook {name}: the docstring must mention firstresult exactly when the hook is firstresult")


def test_undocumented_hook_would_fail(monkeypatch):
    """The check above is not vacuous: a bare hook fails it."""

    @specs.hookspec
    def bare(thing):
        pass

    monkeypatch.setattr(specs, "bare", bare, raising=False)
    assert "bare" in hook_names()
    with pytest.raises(AssertionError, match="no docstring"):
        test_hook_is_documented("bare")


@pytest.mark.parametrize("name", hook_names())
def test_every_hook_has_a_caller_in_core(name):
    """Each hook is called by core itself: no engine or plugin calls hooks (engines get
    sinks and cache tiers through their host), so a hook without a core caller is dead."""
    from pathlib import Path

    root = Path(specs.__file__).resolve().parent.parent / "omlx_core"
    callers = [path for path in root.rglob("*.py")
               if not {"testing", "bench"} & set(path.relative_to(root).parts)
               and f"hook.{name}" in path.read_text()]
    assert callers, f"no module of omlx_core calls hook {name}"
