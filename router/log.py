"""Lifecycle logging: structlog, JSON lines on stderr (never on the request path)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ["configure", "get_logger"]


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at the time of the call.

    structlog's print logger keeps the stream it was created with; a test
    harness that swaps stderr and closes the old one would then break every
    later log line (and the router start-up with it).
    """

    def msg(self, message: str) -> None:
        # One write per line: several processes (a supervisor and its workers)
        # share this stderr, and print() writes the newline separately.
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    debug = info = warning = error = critical = exception = msg


_configured = False


def configure(level: int = logging.INFO) -> None:
    """Once per process: a second call would give structlog a new processor list,
    and the loggers cached under the first would keep the old one (unseen by
    ``structlog.testing.capture_logs``, which changes the current list in place)."""
    global _configured
    if _configured:
        return
    _configured = True
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *args: _Stderr(),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> Any:
    """A lazy logger: safe to create at import, configured at first use."""
    return structlog.get_logger(component=name)
