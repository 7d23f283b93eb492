"""The connection and what every part of the store shares: connect (retrying a restarting Redis), Lua
scripts run by SHA, decoding."""
from __future__ import annotations

import redis
from redis.commands.core import Script




REDIS_OUTAGE_S = 60  # how long a restarting Redis is waited for before an operation gives up


def connect(url: str) -> redis.Redis:
    """A client that rides out a Redis restart: connection errors are retried for about REDIS_OUTAGE_S
    (the AOF brings back everything that was acknowledged). A password in the URL is used."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=REDIS_OUTAGE_S + 6)
    return redis.Redis.from_url(url, decode_responses=False, health_check_interval=30, retry=retry,
                                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])


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


def _s(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _script(source: str) -> Script:
    """A Lua script run by its SHA: the server loads it once (and again after a restart that lost it);
    it works on any connection or pipeline passed as `client`."""
    return Script(None, source.encode())
