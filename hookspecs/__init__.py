"""The contract between omlx-core and its plugins.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names match the
specifications in :mod:`omlx_core.hookspecs.specs`. Register it under the ``omlx_core``
entry-point group of your distribution::

    [project.entry-points.omlx_core]
    my_engine = "my_package.plugin"

Built-in plugins are registered the same way, by omlx-core's own ``pyproject.toml``.
"""

import pluggy

PROJECT_NAME = "omlx_core"
ENTRY_POINT_GROUP = "omlx_core"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "hookimpl", "hookspec"]
