"""Lifecycle logging: structlog, JSON lines on stderr (never on the request path)."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure", "get_logger"]


def configure(level: int = logging.INFO) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A lazy logger: safe to create at import, configured at first use."""
    return structlog.get_logger(component=name)  # type: ignore[no-any-return]
