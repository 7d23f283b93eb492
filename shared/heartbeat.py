"""A beat that keeps a hold alive (a liveness key, a lease): called every `every_s` in a daemon thread until
stopped; a beat that fails (Redis restarting) is logged and the next one tries again. The intervals are
shared.timeouts'."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("sharetune.heartbeat")


def keep_beating(beat: Callable[[], object], every_s: float, what: str,
                 stop: threading.Event | None = None) -> threading.Event:
    """Start beating; returns the event that stops it (`stop`, or a new one)."""
    stop = stop if stop is not None else threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            try:
                beat()
            except Exception:  # noqa: BLE001 - the next beat retries
                log.warning("%s failed", what, exc_info=True)

    threading.Thread(target=run, name=what, daemon=True).start()
    return stop
