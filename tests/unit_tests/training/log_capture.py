"""Captures what the training loop logs (the `megatron.training` logger), for assertions."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from megatron.training.utils import logger


class CaptureHandler(logging.Handler):
    """Keeps the message of every record it handles."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def capture_training_log() -> Iterator[list[str]]:
    """The messages the training loop logs at INFO and above while the block runs (on ranks
    other than 0 nothing: only rank 0 logs)."""
    handler = CaptureHandler()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
