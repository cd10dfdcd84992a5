"""Benchmarks of served models over HTTP: a streaming OpenAI client, server processes,
and ``omlx-core bench`` (omlx-core against ``mlx_lm.server``, see :mod:`.serving`)."""
