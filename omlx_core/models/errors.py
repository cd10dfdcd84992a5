"""The one error type of the models package (kept free of mlx imports so the CLI can
catch it without loading mlx)."""


class ModelError(Exception):
    """A configured model cannot be found, converted or read; the message says how to fix it."""
