"""How a worker that must not serve on ends: at once, with its reason logged in one line, and an exit code its
supervisor (or compose's restart limit) tells apart from a crash."""
from __future__ import annotations

import logging
import os

STARTUP_FAILED = 3  # a start-up step failed: the worker never took a message
CLAIM_LOST = 4  # a lane replica's slot is held by another replica now: two must never consume one lane


def exit_now(code: int, log: logging.Logger, message: str, *args, exc_info: bool = False) -> None:
    """Log, flush every handler and end the process without unwinding (a Celery worker would otherwise go on
    consuming: what a signal handler or a thread raises is only logged)."""
    log.error(message, *args, exc_info=exc_info)
    for h in logging.getLogger().handlers + log.handlers:
        h.flush()
    os._exit(code)
