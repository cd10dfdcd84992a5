"""The serving pipeline: the one path every caller takes to run a request.

HTTP, the benchmarks and an embedding program all go through
:class:`~omlx_core.serving.pipeline.ServingPipeline`: a :class:`Job` in, a started
:class:`Generation` out (or a typed error before any work or byte); an
:class:`EncodeJob` in, its vectors or scores out (:mod:`omlx_core.serving.encode`). See
:mod:`omlx_core.serving.pipeline` for the order of the checks,
:mod:`omlx_core.serving.output` for how the engine's token ids become text, and
:mod:`omlx_core.serving.reasoning` for how a reply splits into thinking, content and
tool calls.
"""

from omlx_core.memory.types import RequestRejected
from omlx_core.serving.output import LogprobEntry, OutputProcessor, StopMatcher
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
from omlx_core.serving.encode import EncodeJob, EncodeResult
from omlx_core.serving.reasoning import ReasoningRequest
from omlx_core.serving.tools import ToolRequest

__all__ = ["Delta", "EncodeJob", "EncodeResult", "EngineFailed", "Generation", "InvalidRequest",
           "Job", "LogprobEntry", "OutputProcessor", "ReasoningRequest", "RequestAborted",
           "RequestRejected", "ServingEvents", "ServingPipeline", "StopMatcher", "ToolRequest",
           "UnknownModel"]
