"""Reading one figure of a running server's ``/metrics`` (Prometheus text), for tests."""

from __future__ import annotations

import http.client


def metric_value(port: int, name: str, host: str = "127.0.0.1") -> float:
    """The value of the first sample of metric ``name`` (labelled or not) on the server at
    ``host:port``; ``AssertionError`` with the whole page when it has none."""
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", "/metrics")
    body = connection.getresponse().read().decode()
    connection.close()
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{body}")


__all__ = ["metric_value"]
