"""The daemon connection lives in the core package (a2ad.connection), so that tools that
import no torch can use it; re-exported here for client code."""

from a2ad.connection import DEFAULT_TIMEOUT, DaemonClient, ping

__all__ = ["DEFAULT_TIMEOUT", "DaemonClient", "ping"]
