pytest_plugins = ["omlx_core.testing.pytest_fixtures"]
