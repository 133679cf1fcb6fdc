"""Ports on this machine's loopback for the servers tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port no one listens on now (the server the test starts takes it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
