"""Memory: how much this machine can give, how much a request will take, and the guard
between the two.

- :mod:`~omlx_core.memory.probes` reads the machine (RAM, cgroup, Metal, CUDA, own RSS);
- :mod:`~omlx_core.memory.ceilings` turns readings and the tier into the four ceilings;
- :mod:`~omlx_core.memory.usage` says how much this process holds now;
- :mod:`~omlx_core.memory.enforcer` publishes a limit snapshot to every engine each poll;
- :mod:`~omlx_core.memory.guard` refuses what can never fit (preflight, HTTP 413) and
  runs admission; it is what the serving pipeline calls;
- :mod:`~omlx_core.memory.admission` makes what fits alone wait for room (HTTP 503 when
  the queue is full);
- :mod:`~omlx_core.memory.gate` is the engine's side: the forward-gate contract and the
  receiver of limit snapshots; :mod:`~omlx_core.memory.forward_gate` is the guard's
  gate, which refuses a prefill chunk before its forward runs;
- :mod:`~omlx_core.memory.types` holds the values that cross the memory hooks (the
  structured ``PeakEstimate`` the ``estimate_peak`` hook answers among them), and the
  one rejection type, ``RequestRejected``.

How much a prefill will add is the business of an ``estimate_peak`` plugin (the
built-in one is ``omlx_core.plugins.estimator``); the guard uses its answer as is. What
mlx itself holds (and which backend it runs on) is asked of
:mod:`omlx_core.platform.backend` alone, and only on the enforcer's and the MLX
thread: the request thread judges against the last published snapshot.
"""
