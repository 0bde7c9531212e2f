"""What the renderer, ``submit`` and the lifecycle commands share about kubectl and labels.

Torch-free and yaml-free, so ``slipstream status`` needs neither.

Example::

    JOB_LABEL                                   # 'slipstream.dev/job', on every object the renderer makes
    cluster_unreachable("dial tcp 127.0.0.1:1: connect: connection refused")   # True
"""

from __future__ import annotations

JOB_LABEL = "slipstream.dev/job"
"""The label every rendered object carries (value: the job's name); lifecycle commands select by it."""

NO_CLUSTER_HINTS = (
    "connection to the server", "unable to connect to the server", "connection refused", "was refused",
    "no such host", "i/o timeout", "context deadline exceeded", "couldn't get current server api group list",
    "no configuration has been provided", "invalid configuration", "dial tcp", "tls handshake timeout",
    "error: eof", "the server has asked for the client to provide credentials", "you must be logged in",
)
"""Fragments of kubectl's messages (lower case) that mean no cluster answered, not that it refused.
(A 404, "the server could not find the requested resource", is an answer: the cluster lacks the kind.)"""


def cluster_unreachable(kubectl_error: str) -> bool:
    """Whether kubectl's error text says that no API server answered (kubeconfig, network, credentials)."""
    low = kubectl_error.lower()
    return any(h in low for h in NO_CLUSTER_HINTS)


__all__ = ["JOB_LABEL", "NO_CLUSTER_HINTS", "cluster_unreachable"]
