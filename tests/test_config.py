"""Tier files, inheritance, overrides, provenance, and errors that name file, key and fix."""

from __future__ import annotations

import textwrap

import pytest

from omlx_core.config import ConfigError, load_config, pick_tier, tier_names
from omlx_core.settings import Setting, parse_size


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("tier", ["cpu-small", "laptop-16gb", "workstation-128gb", "cuda-80gb"])
def test_shipped_tiers_load_and_inherit_base(tier):
    config = load_config(tier, env={})
    assert config.tier == tier
    assert config["server.host"] == "127.0.0.1"
    assert config.source("server.host").endswith("base.toml")
    assert "smollm2-135m-instruct" in config.models
    assert set(config.memory_tier()) == {"reserve_fraction", "reserve_min", "dynamic_factor",
                                         "admit_watermark"}


def test_the_four_hardware_tiers_ship():
    assert {"cpu-small", "laptop-16gb", "workstation-128gb", "cuda-80gb"} <= set(tier_names())


def test_tier_value_overrides_base_and_remembers_its_file():
    config = load_config("cpu-small", env={})
    assert config["plugin.batched.prefill_step_size"] == 256
    assert config.source("plugin.batched.prefill_step_size").endswith("cpu-small.toml")


def test_layering_order_file_then_env_then_cli(tmp_path):
    extra = write(tmp_path, "mine.toml", """
        [plugin.batched]
        max_batch_size = 4
        prefill_step_size = 128
        """)
    config = load_config("cpu-small", files=[extra],
                         env={"OMLX_PLUGIN_BATCHED_PREFILL_STEP_SIZE": "64",
                              "OMLX_SERVER_PORT": "9000"},
                         overrides=[("server.port", "9100", "cli --port")])
    assert config["plugin.batched.max_batch_size"] == 4
    assert config.source("plugin.batched.max_batch_size") == str(extra)
    assert config["plugin.batched.prefill_step_size"] == 64
    assert config.source("plugin.batched.prefill_step_size") == "env OMLX_PLUGIN_BATCHED_PREFILL_STEP_SIZE"
    assert config["server.port"] == 9100
    assert config.source("server.port") == "cli --port"


def test_custom_tier_inherits_a_shipped_tier_by_name(tmp_path):
    mine = write(tmp_path, "edge.toml", """
        base = ["cpu-small"]
        [memory]
        tier = "custom"
        custom_ceiling = "1.5GiB"
        """)
    config = load_config(str(mine), env={})
    assert config["plugin.batched.prefill_step_size"] == 256  # from cpu-small
    assert config["memory.custom_ceiling"] == int(1.5 * 1024**3)
    assert config["memory.tier"] == "custom"


def test_unknown_key_names_file_key_and_nearest_valid_key(tmp_path):
    bad = write(tmp_path, "bad.toml", """
        base = ["base"]
        [plugin.batched]
        max_batch_sise = 8
        """)
    with pytest.raises(ConfigError) as err:
        load_config(str(bad), env={})
    message = str(err.value)
    assert str(bad) in message
    assert "plugin.batched.max_batch_sise" in message
    assert "did you mean 'max_batch_size'" in message


def test_a_setting_that_moved_to_its_plugin_says_where(tmp_path):
    old = write(tmp_path, "old.toml", """
        base = ["base"]
        [engine]
        max_batch_size = 8
        """)
    with pytest.raises(ConfigError, match="moved to 'plugin.batched.max_batch_size'"):
        load_config(str(old), env={})


def test_unknown_section_is_an_error_with_suggestion(tmp_path):
    bad = write(tmp_path, "bad.toml", """
        base = ["base"]
        [engnie]
        max_tokens = 8
        """)
    with pytest.raises(ConfigError, match="did you mean 'engine.max_tokens'"):
        load_config(str(bad), env={})


def test_wrong_type_names_expected_form(tmp_path):
    bad = write(tmp_path, "bad.toml", """
        base = ["base"]
        [server]
        port = "eighty"
        """)
    with pytest.raises(ConfigError) as err:
        load_config(str(bad), env={})
    assert "server.port" in str(err.value)
    assert "expected an integer between 0 and 65535" in str(err.value)


def test_bad_value_out_of_range_and_bad_choice(tmp_path):
    bad = write(tmp_path, "bad.toml", """
        base = ["base"]
        [server]
        port = 70000
        [memory]
        tier = "reckless"
        """)
    with pytest.raises(ConfigError) as err:
        load_config(str(bad), env={})
    assert len(err.value.problems) == 2
    text = str(err.value)
    assert "above the maximum 65535" in text
    assert "one of 'safe', 'balanced', 'aggressive', 'custom'" in text


def test_bad_size_string(tmp_path):
    bad = write(tmp_path, "bad.toml", """
        base = ["base"]
        [plugin.batched]
        prefix_cache_budget = "lots"
        """)
    with pytest.raises(ConfigError, match=r"plugin.batched.prefix_cache_budget: 'lots' is not a size"):
        load_config(str(bad), env={})


def test_invalid_toml_names_the_file_and_position(tmp_path):
    bad = write(tmp_path, "broken.toml", "[engine\nmax_batch_size = 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad), env={})
    assert "broken.toml" in str(err.value) and "not valid TOML" in str(err.value)
    assert "line 1" in str(err.value)


def test_missing_base_is_reported(tmp_path):
    lonely = write(tmp_path, "lonely.toml", "[engine]\nmax_batch_size = 2\n")
    with pytest.raises(ConfigError, match="every tier must inherit base"):
        load_config(str(lonely), env={})


def test_inheritance_cycle_is_reported(tmp_path):
    write(tmp_path, "a.toml", 'base = ["b.toml"]\n')
    write(tmp_path, "b.toml", 'base = ["a.toml"]\n')
    with pytest.raises(ConfigError, match="inheritance cycle"):
        load_config(str(tmp_path / "a.toml"), env={})


def test_unknown_tier_name_suggests_shipped_ones():
    with pytest.raises(ConfigError) as err:
        load_config("cpu-smal", env={})
    assert "did you mean 'cpu-small'" in str(err.value)


def test_env_values_are_parsed_by_type_and_errors_name_the_variable():
    config = load_config("cpu-small", env={"OMLX_SERVER_API_KEYS": "a, b",
                                           "OMLX_MEMORY_CUSTOM_CEILING": "512MiB"})
    assert config["server.api_keys"] == ["a", "b"]
    assert config["memory.custom_ceiling"] == 512 * 1024**2
    with pytest.raises(ConfigError, match="env OMLX_SERVER_THREADS"):
        load_config("cpu-small", env={"OMLX_SERVER_THREADS": "many"})


def test_unknown_omlx_variable_is_a_warning_with_suggestion():
    warnings: list[str] = []
    load_config("cpu-small", env={"OMLX_SERVER_PROT": "1"}, warnings=warnings)
    assert any("OMLX_SERVER_PROT" in w and "OMLX_SERVER_PORT" in w for w in warnings)


def test_models_need_exactly_one_source_and_served_models_must_exist(tmp_path):
    bad = write(tmp_path, "bad.toml", """
        base = ["base"]
        [server]
        models = ["tiny"]
        [models.tiny]
        engine = "batched"
        [models.other]
        path = "/x"
        gguf = "/y.gguf"
        """)
    with pytest.raises(ConfigError) as err:
        load_config(str(bad), env={})
    text = str(err.value)
    assert "models.tiny: set exactly one of path, hub_id, gguf or embedded" in text
    assert "found: path, gguf" in text


def test_plugin_settings_are_validated_with_their_declared_schema(tmp_path):
    mine = write(tmp_path, "p.toml", """
        base = ["base"]
        [plugin.ssd]
        directory = "/tmp/x"
        budgte = 3
        """)
    settings = {"ssd": [Setting("directory", "str", "where", default="/var"),
                        Setting("budget", "size", "bytes", default=0)]}
    with pytest.raises(ConfigError, match="did you mean 'budget'"):
        load_config(str(mine), env={}, plugin_settings=settings)
    good = write(tmp_path, "g.toml", 'base = ["base"]\n[plugin.ssd]\nbudget = "1GiB"\n')
    config = load_config(str(good), env={}, plugin_settings=settings)
    assert config.plugin("ssd") == {"directory": "/var", "budget": 1024**3}
    with pytest.raises(ConfigError, match="no loaded plugin named 'ssdd'"):
        load_config(str(write(tmp_path, "h.toml", 'base = ["base"]\n[plugin.ssdd]\nx = 1\n')),
                    env={}, plugin_settings=settings)


def test_pick_tier_by_machine():
    assert pick_tier("Linux", 24 * 1024**3, cuda=False) == "cpu-small"
    assert pick_tier("Linux", 512 * 1024**3, cuda=True) == "cuda-80gb"
    assert pick_tier("Darwin", 16 * 1024**3, cuda=False) == "laptop-16gb"
    assert pick_tier("Darwin", 128 * 1024**3, cuda=False) == "workstation-128gb"


@pytest.mark.parametrize("text,expected", [
    ("1536", 1536), ("1.5GiB", 1610612736), ("512MiB", 536870912), ("2GB", 2_000_000_000),
    ("10 kib", 10240), (0, 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1", "1.5XB", "", "GiB", True])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_float_settings_refuse_nan_and_infinities(tmp_path, text):
    bad = write(tmp_path, "bad.toml", f"""
        base = ["base"]
        [memory]
        queue_timeout_s = {text}
        """)
    with pytest.raises(ConfigError, match=r"memory.queue_timeout_s: .* is not a finite number"):
        load_config(str(bad), env={})
    with pytest.raises(ConfigError, match="OMLX_MEMORY_POLL_INTERVAL_S"):
        load_config("cpu-small", env={"OMLX_MEMORY_POLL_INTERVAL_S": text.upper()})
