"""Developer benchmarks: each prints a table (and with ``--out`` writes it as markdown).

Not part of the installed package. Run one from the repository root, either way::

    python -m benchmarks.http_cost
    python benchmarks/http_cost.py

They use omlx-core only through public names (``tests/test_benchmarks.py`` checks it),
mostly the serving pipeline, :func:`omlx_core.bootstrap.served_models` and
:mod:`omlx_core.bench`, the client and server harness behind ``omlx-core bench``.
BENCHMARKS.md lists them with their latest figures.
"""
