"""Structured server logs: one JSON object per line on stderr, every request event carrying
its `request_id`, so a trainer's request can be followed through admission, streaming and
its end (finished, aborted, failed)."""

from __future__ import annotations

import json
import logging
import sys
import time

LOGGER_NAME = "rollout.server"


class JsonFormatter(logging.Formatter):
    """Formats `log_event` records as one JSON line: ts, level, event, then the fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "info") -> None:
    """Routes the server logger to stderr as JSON lines (called once by `rollout serve`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def log_event(event: str, level: int = logging.INFO, exc_info: bool = False, **fields) -> None:
    """Logs `event` with structured fields (request_id, counts, durations)."""
    logging.getLogger(LOGGER_NAME).log(level, event, extra={"fields": fields}, exc_info=exc_info)


def elapsed_ms(start: float) -> float:
    """Milliseconds since a `time.perf_counter()` reading, rounded for logs."""
    return round((time.perf_counter() - start) * 1e3, 2)
