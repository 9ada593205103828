"""Logging for every long-running command: plain text, one line per record, quiet by default.

Colour and terminal escape codes only when the stream is a terminal (``NO_COLOR`` turns
them off there too); the Kafka clients' per-message chatter stays at WARNING unless asked.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
NOISY = ("aiokafka", "kafka", "faust", "mode", "aiohttp.access", "httpx", "httpcore")


def use_colour(stream: object = None) -> bool:
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def configure_logging(level: str = "WARNING") -> None:
    """Root logger at ``level`` with a plain formatter on stderr (replaces earlier handlers)."""
    logging.basicConfig(level=level.upper(), format=FORMAT, stream=sys.stderr, force=True)
    floor = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    for name in NOISY:
        logging.getLogger(name).setLevel(floor if level.upper() != "DEBUG" else logging.DEBUG)


def logging_dict_config(level: str = "WARNING", stream: object = None) -> dict[str, Any] | None:
    """A ``logging.config.dictConfig`` of one plain stderr handler, for frameworks that set
    up their own (Faust's is coloured with escape codes); None on a terminal (theirs is fine)."""
    if use_colour(stream):
        return None
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT}},
        "handlers": {
            "plain": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": level.upper(), "handlers": ["plain"]},
        "loggers": {name: {"level": "WARNING"} for name in NOISY if level.upper() != "DEBUG"},
    }
