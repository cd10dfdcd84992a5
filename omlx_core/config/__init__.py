"""Configuration: shipped hardware tiers, layered TOML, environment and CLI overrides."""

from omlx_core.config.loader import (
    Config,
    ConfigError,
    ModelEntry,
    Problem,
    Sourced,
    env_name,
    load_config,
    parse_set_flag,
    pick_tier,
    raw_value,
    read_layers,
    tier_description,
    tier_names,
)

__all__ = [
    "Config", "ConfigError", "ModelEntry", "Problem", "Sourced", "env_name", "load_config",
    "parse_set_flag", "pick_tier", "raw_value", "read_layers", "tier_description", "tier_names",
]
