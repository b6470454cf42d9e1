"""The one error the server room raises: tritonserver could not start, stay up or answer."""
from __future__ import annotations


class ServerError(RuntimeError):
    """tritonserver could not be started or did not become ready; the message says why."""
