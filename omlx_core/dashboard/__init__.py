"""What the operator's dashboard shows, as data: a 15-minute history the memory
enforcer fills at every poll (:mod:`.history`, :mod:`.recorder`), the last refusals,
the requests in flight and the served models (:mod:`.views`). The HTTP side
(:mod:`omlx_core.http.dashboard`) renders these as JSON and serves the page in
``assets/``."""

from omlx_core.dashboard.history import HISTORY_S, History, Sample
from omlx_core.dashboard.recorder import DashboardRecorder, Refusal, ServingEventsFanOut

__all__ = ["HISTORY_S", "DashboardRecorder", "History", "Refusal", "Sample",
           "ServingEventsFanOut"]
