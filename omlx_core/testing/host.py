"""Engine hosts for tests: what :func:`omlx_core.bootstrap.build_host` gives an engine in
a server, with the sinks and cache tiers a test chooses instead of the plugins'."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from omlx_core.config import Config, load_config
from omlx_core.host import EngineHost
from omlx_core.mlx_thread import MLXThread, mlx_thread


def make_test_host(config: Config | str = "cpu-small", *, model_id: str = "test",
                   lower_tiers: Sequence[Any] = (),
                   on_boundary_snapshot: Callable[[Any], None] | None = None,
                   on_request_finished: Callable[[str, str], None] | None = None,
                   thread: MLXThread | None = None) -> EngineHost:
    """A host over ``config`` (a :class:`~omlx_core.config.Config` or a tier name), the
    process's MLX thread, the given lower cache tiers, and sinks that ignore what they
    get unless given. ``model_id`` names the model whose ``[models.<id>]`` settings
    :meth:`EngineHost.model_setting` reads."""
    host = EngineHost(model_id=model_id,
                      config=load_config(config) if isinstance(config, str) else config,
                      thread=thread or mlx_thread(), lower_tiers=tuple(lower_tiers))
    if on_boundary_snapshot is not None:
        host.on_boundary_snapshot = on_boundary_snapshot
    if on_request_finished is not None:
        host.on_request_finished = on_request_finished
    return host


__all__ = ["make_test_host"]
