"""Memory: how much this machine can give, how much a request will take, and the guard
between the two. :mod:`omlx_core.memory.probes` reads the machine."""
