"""The connection and what every part of the store shares: connect (retrying a restarting Redis), Lua
scripts run by SHA, decoding."""
from __future__ import annotations

import threading
import time
from typing import overload

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

REDIS_OUTAGE_S = 60  # a client's default: how long a restarting Redis is waited for before an operation gives up
CONNECT_TIMEOUT_S = 5.0  # one connection attempt: an unreachable host costs this, not the kernel's SYN timeout

_gave_up_at: list[float] = [0.0]  # when this process last gave up waiting for Redis (time.time())


class OutageRetry(Retry):
    """Retries connection errors until `outage_s` have passed since the operation's first one (a time, not a
    count: an attempt may fail at once or after its connect timeout). Giving up is recorded for
    `outage_since`, because the error may reach its handler wrapped or re-raised as another type.
    redis-py retries a connect inside a command's retry: the inner one tries once, so one window bounds both."""

    _active = threading.local()

    def __init__(self, outage_s: float):
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), retries=-1)
        self.outage_s = float(outage_s)

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        if getattr(self._active, "depth", 0):
            return do()
        self._active.depth = 1
        try:
            return self._until_window_ends(do, fail, is_retryable, with_failure_count)
        finally:
            self._active.depth = 0

    def _until_window_ends(self, do, fail, is_retryable, with_failure_count):
        self._backoff.reset()
        failures, first = 0, None
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                first = first if first is not None else time.monotonic()
                left = self.outage_s - (time.monotonic() - first)
                if left <= 0:
                    note_unreachable()
                    raise
                time.sleep(min(self._backoff.compute(failures), left))


def connect(url: str, outage_s: float = REDIS_OUTAGE_S) -> redis.Redis:
    """A client that rides out a Redis restart or outage: connection errors are retried for `outage_s`
    (the AOF brings back everything that was acknowledged). A password in the URL is used."""
    return redis.Redis.from_url(url, decode_responses=False, health_check_interval=30, retry=OutageRetry(outage_s),
                                socket_connect_timeout=CONNECT_TIMEOUT_S,
                                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])


def note_unreachable() -> None:
    """Record that an operation of this process gave up on Redis (or on the broker, which is Redis)."""
    _gave_up_at[0] = time.time()


def outage_since(t0: float, err: BaseException | None = None) -> bool:
    """Whether an error since `t0` came from Redis being away rather than from the work: this process gave
    up waiting for it since then, or the error (or what caused it) is a connection error. Such an error is
    no job's fault: the work's lease lapses and it is sent again once Redis is back."""
    if _gave_up_at[0] >= t0:
        return True
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            return True
        err = err.__cause__ or err.__context__
    return False


def unreachable(url: str, timeout_s: float) -> str | None:
    """One ping with a connect timeout and no retries: None when Redis answers, else why not (one line).
    For a quick check before work starts, not for the services' connection (see connect)."""
    try:
        r = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            r.ping()
        finally:
            r.close()
    except (redis.exceptions.RedisError, ValueError, OSError) as err:
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    return None


def connect_probe(url: str, timeout_s: float) -> redis.Redis:
    """A client for a health probe: no retries, each call answered or failed within timeout_s."""
    return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)


def masked_url(url: str | None) -> str | None:
    """The URL with its password as ****, for printing and logs (redis://sharetune:****@127.0.0.1:6379/0)."""
    if not url:
        return url
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:****@{host}"))


@overload
def _s(v: None) -> None: ...


@overload
def _s(v: bytes | str) -> str: ...


def _s(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _script(source: str) -> Script:
    """A Lua script run by its SHA: the server loads it once (and again after a restart that lost it);
    it works on any connection or pipeline passed as `client`."""
    return Script(None, source.encode())  # type: ignore[arg-type]  # no client of its own: each call passes one
