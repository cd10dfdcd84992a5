"""Plugin discovery through the entry-point group, selection, and broken-plugin errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from omlx_core.hookspecs import hookimpl
from omlx_core.pluginmanager import PluginError, build_plugin_manager


def make_distribution(root, dist, version, entry_points, modules):
    """A real installed distribution on disk: a dist-info directory plus its modules."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[omlx_core]\n{lines}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    make_distribution(tmp_path, "omlx-thirdparty", "2.3.0", {
        "good": "tp_good", "broken": "tp_broken", "typo": "tp_typo",
    }, {
        "tp_good": """
            from omlx_core.hookspecs import hookimpl

            @hookimpl
            def register_engines(register):
                register("echo", object)

            @hookimpl
            def on_rejection(rejection):
                return "third-party advice"
            """,
        "tp_broken": "import module_that_does_not_exist\n",
        "tp_typo": """
            from omlx_core.hookspecs import hookimpl

            @hookimpl
            def on_rejectoin(rejection):
                return None
            """,
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("tp_good", "tp_broken", "tp_typo"):
        sys.modules.pop(name, None)
    return tmp_path


def test_builtin_plugins_load_through_the_entry_point_group():
    manager = build_plugin_manager()
    info = manager.infos["batched"]
    assert info.source == "built-in"
    assert info.distribution == "omlx-core"
    assert info.error is None
    assert "register_engines" in info.hooks
    assert "batched" in manager.engines()


def test_third_party_plugin_is_discovered_with_its_distribution(third_party):
    manager = build_plugin_manager()
    good = manager.infos["good"]
    assert good.source == "distribution omlx-thirdparty"
    assert good.version == "2.3.0"
    assert good.hooks == ["on_rejection", "register_engines"]
    assert "echo" in manager.engines()


def test_import_failure_is_recorded_with_plugin_and_distribution(third_party):
    manager = build_plugin_manager()
    broken = manager.infos["broken"]
    assert broken.status == "broken"
    assert "module_that_does_not_exist" in broken.error
    with pytest.raises(PluginError) as err:
        manager.require(["broken"])
    assert "'broken'" in str(err.value)
    assert "distribution omlx-thirdparty" in str(err.value)


def test_unknown_hook_is_rejected_with_a_suggestion(third_party):
    manager = build_plugin_manager()
    typo = manager.infos["typo"]
    assert typo.status == "broken"
    assert "unknown hook 'on_rejectoin'" in typo.error
    assert "Did you mean 'on_rejection'" in typo.error
    assert not manager.hook_manager.has_plugin("typo")


def test_enable_and_disable_by_name(third_party):
    manager = build_plugin_manager(enabled=["batched", "good"], disabled=["good"])
    assert manager.infos["good"].status == "disabled"
    assert manager.infos["broken"].status == "disabled"
    assert manager.hook_manager.has_plugin("batched")
    with pytest.raises(PluginError, match="required but disabled"):
        manager.require(["good"])


def test_enabled_but_missing_plugin_is_reported():
    manager = build_plugin_manager(enabled=["batched", "nonexistent"])
    with pytest.raises(PluginError, match="'nonexistent'.*not installed"):
        manager.require(["nonexistent"])


def test_in_process_plugin_registers_and_unregisters():
    manager = build_plugin_manager()
    plugin = types.SimpleNamespace()

    @hookimpl
    def on_rejection(rejection):
        return "check your swap"

    plugin.on_rejection = on_rejection
    manager.register(plugin, "test-advice")
    assert manager.hook.on_rejection(rejection=None) == ["check your swap"]
    manager.unregister("test-advice")
    assert "check your swap" not in manager.hook.on_rejection(rejection=None)


def test_two_plugins_registering_one_engine_name_is_an_error():
    manager = build_plugin_manager()
    clash = types.SimpleNamespace()

    @hookimpl
    def register_engines(register):
        register("batched", object)

    clash.register_engines = register_engines
    manager.register(clash, "clash")
    with pytest.raises(PluginError, match="'batched' is registered by both"):
        manager.engines()


def run_cli(*args, env_extra=None):
    env = {**os.environ, "OMLX_NO_BLAS_REEXEC": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "omlx_core", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_cli_plugins_lists_name_version_source_and_hooks(third_party):
    result = run_cli("plugins", "--tier", "cpu-small",
                     env_extra={"PYTHONPATH": str(third_party)})
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# tier cpu-small: plugin stack: ") and "good" in lines[0]
    assert lines[1].split() == ["NAME", "VERSION", "SOURCE", "STATUS", "HOOKS"]
    batched = next(line for line in lines if line.startswith("batched"))
    assert "built-in" in batched and "register_engines" in batched
    good = next(line for line in lines if line.startswith("good"))
    assert "2.3.0" in good and "distribution omlx-thirdparty" in good
    assert "broken: failed to import tp_broken" in result.stdout
    assert result.returncode == 1  # a broken plugin is worth a non-zero exit

    as_json = json.loads(run_cli("plugins", "--json", "--tier", "cpu-small").stdout)
    assert {p["name"]: p["source"] for p in as_json}["batched"] == "built-in"


def test_cli_reports_a_bad_tier_file_with_file_key_and_fix(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('base = ["cpu-small"]\n[server]\nthreds = 4\n')
    result = run_cli("config", "show", "--tier", str(bad))
    assert result.returncode == 2
    assert f"{bad}: server.threds: unknown key; did you mean 'server.threads'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_config_show_prints_values_with_sources():
    result = run_cli("config", "show", "--tier", "cpu-small", "--set", "engine.max_tokens=99",
                     env_extra={"OMLX_SERVER_PORT": "8123"})
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line and line[0] != "#"}
    assert rows["engine.max_tokens"].split()[1:] == ["99", "cli", "--set", "engine.max_tokens=99"]
    assert rows["server.port"].split()[1:] == ["8123", "env", "OMLX_SERVER_PORT"]
    assert rows["plugin.batched.prefill_step_size"].endswith("cpu-small.toml")
    assert rows["memory.tier"].endswith("cpu-small.toml")


def test_cli_config_show_never_prints_api_keys():
    result = run_cli("config", "show", "--tier", "cpu-small", "--json",
                     env_extra={"OMLX_SERVER_API_KEYS": "sk-secret-one,sk-secret-two"})
    assert result.returncode == 0, result.stderr
    assert "sk-secret" not in result.stdout
    settings = json.loads(result.stdout)["settings"]
    assert settings["server.api_keys"]["value"] == "<2 key(s) hidden>"
