"""The HTTP front end: OpenAI- and Anthropic-compatible endpoints on Falcon + waitress."""

from omlx_core.http.app import Frontend, build_frontend, create_app
from omlx_core.http.serve import HTTPServer, serve_forever

__all__ = ["Frontend", "HTTPServer", "build_frontend", "create_app", "serve_forever"]
