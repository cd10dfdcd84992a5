"""The serving pipeline: the one path every caller takes to run a request.

HTTP, the benchmarks and an embedding program all go through
:class:`~omlx_core.serving.pipeline.ServingPipeline`: a :class:`Job` in, a started
:class:`Generation` out (or a typed error before any work or byte). See
:mod:`omlx_core.serving.pipeline` for the order of the checks.
"""

from omlx_core.memory.types import RequestRejected
from omlx_core.serving.pipeline import (
    Delta,
    EngineFailed,
    Generation,
    InvalidRequest,
    Job,
    RequestAborted,
    ServingEvents,
    ServingPipeline,
    UnknownModel,
)
from omlx_core.serving.tools import ToolRequest

__all__ = ["Delta", "EngineFailed", "Generation", "InvalidRequest", "Job", "RequestAborted",
           "RequestRejected", "ServingEvents", "ServingPipeline", "ToolRequest", "UnknownModel"]
