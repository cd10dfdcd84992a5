"""Built-in plugins. Each is registered through the ``omlx_core`` entry-point group in
omlx-core's own pyproject.toml, exactly as a third-party plugin is."""
