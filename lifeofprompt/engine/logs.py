"""The package's log lines on stderr, readable without any logging set-up (as vLLM's are).

Each line is ``LEVEL hh:mm:ss who: message``: the level is the record's own (a warning says
WARNING), and ``who`` names the part that speaks (``engine``, ``server``). A program that has
configured logging itself keeps its own handlers: ``log_to_stderr`` then adds nothing.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(levelname)s %(asctime)s {who}: %(message)s"
TIME_FORMAT = "%H:%M:%S"


def stderr_handler(who: str, stream=None) -> logging.Handler:
    """A handler writing ``LEVEL hh:mm:ss who: message`` lines to ``stream`` (default: stderr)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(who=who), TIME_FORMAT))
    return handler


def log_to_stderr(log: logging.Logger, who: str, stream=None, defer_to_root: bool = True) -> bool:
    """Give ``log`` a stderr handler at INFO unless one is configured; True when it added one.

    Configured means a handler on ``log`` itself or, with ``defer_to_root``, on the root logger
    (``logging.basicConfig`` or an application's own set-up): then the records go where that set-up
    says, at its levels. Without one, Python would print only warnings, bare, and drop the INFO lines
    (start-up, shutdown) a server's operator needs.
    """
    if log.handlers or (defer_to_root and logging.getLogger().handlers):
        return False
    log.addHandler(stderr_handler(who, stream))
    log.setLevel(logging.INFO)
    log.propagate = False
    return True
