"""Errors of the local infrastructure, each carrying what a person needs to act on it."""


class InfraError(RuntimeError):
    """Something about a local server or its bootstrap is wrong."""


class FetchError(InfraError):
    """A server's class path or package could not be installed."""


class StartError(InfraError):
    """A server did not become ready; the message carries the tail of its log."""
