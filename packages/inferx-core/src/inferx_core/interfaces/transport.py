"""The transport contract: serves an engine to clients (HTTP today)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Transport(ABC):
    """Exposes an engine to clients. Chosen by name in config ([server] transport)."""

    @abstractmethod
    def __init__(self, engine: Any, config: Any) -> None:
        """engine: an inferx_core.engine.AsyncEngine; config: the whole inferx_core Config."""

    @abstractmethod
    def serve(self) -> None:
        """Serve until told to stop (SIGTERM drains); returns when stopped."""
