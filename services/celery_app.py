"""The one Celery app factory: JSON only, size-capped, late acknowledgement, one message at a time per
worker; a message a worker refuses to decode (pickle, too large, not JSON) is dead-lettered, not lost
silently. Below Celery, the Redis transport admits a raw queue entry only once it is a kombu envelope of a
bounded size (`admit_entry`): any other bytes on a queue are dead-lettered with the queue's name, never a
worker's crash.

It lives in `services`, beside the services whose tasks.py use it (and the client, which publishes plan
messages with it), not in `shared`: whatever imports `shared` (the store, the contracts, the API, reports)
then never loads Celery or kombu, and importing this module changes nothing until an app is made."""
from __future__ import annotations

import base64
import binascii
import logging

from celery import Celery
from celery.worker.consumer import Consumer
from kombu.exceptions import KombuError
from kombu.serialization import register
from kombu.transport.redis import Channel as RedisChannel
from kombu.transport.redis import Transport as RedisTransport
from kombu.transport.virtual import Empty
from kombu.utils.json import dumps as _json_dumps
from kombu.utils.json import loads as _json_loads

from shared import names, timeouts
from shared.messages import MAX_MESSAGE_BYTES

# every message priority the Redis transport keeps apart, 0 served first (kombu keeps 0, 3, 6, 9 by default):
# a job's fair step and, within it, its head tasks' first rounds (services.tuner.allocation.message_priority)
PRIORITY_STEPS = list(range(10))

MAX_TASKS_PER_CHILD = 200  # prefork pools recycle a child after this many tasks (our lanes are solo: they
# recycle their sandbox child instead, see LaneSettings.sandbox_recycle)

log = logging.getLogger("sharetune.celery")


class MessageTooLarge(ValueError):
    pass


def _loads_capped(data):
    """JSON decoding with the size cap checked before parsing (a 100 MB body never reaches json.loads)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes")
    return _json_loads(data)


def register_capped_json() -> None:
    """Replace kombu's "json" codec with the size-capped one. kombu keeps one codec registry per process,
    so this is done by make_celery, for the processes that make an app, never by importing this module.
    The content type is kombu's own, so producers are unchanged; only decoding gains the cap."""
    register("json", _json_dumps, _loads_capped, content_type="application/json", content_encoding="utf-8")


def _dead_letter_refused(consumer, message, exc) -> None:
    """Keep a trace of a refused message (never its decoded body: it may be a pickle)."""
    try:
        from shared import store

        info = getattr(message, "delivery_info", {}) or {}
        source = info.get("routing_key") or info.get("exchange") or "?"
        body = getattr(message, "body", b"") or b""
        why = f"refused message ({message.content_type}, {len(body)} bytes): {type(exc).__name__}: {exc}"
        store.dead_letter(store.connect(consumer.app.conf.broker_url), source, why[:1000], "")
    except Exception:  # noqa: BLE001 - the refusal itself must not take the worker down
        log.warning("could not dead-letter a refused message", exc_info=True)


class GuardedConsumer(Consumer):
    """Celery's consumer, plus a dead-letter entry for every message it refuses to decode or to run."""

    def on_decode_error(self, message, exc):
        _dead_letter_refused(self, message, exc)
        super().on_decode_error(message, exc)

    def on_invalid_task(self, body, message, exc):
        _dead_letter_refused(self, message, exc)
        super().on_invalid_task(body, message, exc)

    def on_unknown_message(self, body, message):
        _dead_letter_refused(self, message, ValueError("not a task message (no task name)"))
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc):
        _dead_letter_refused(self, message, exc)
        super().on_unknown_task(body, message, exc)


# ---- the raw queue entry -----------------------------------------------------------------------------------

# kombu's envelope carries the body base64-encoded: a body at the message cap fits in this
MAX_ENTRY_BYTES = MAX_MESSAGE_BYTES * 4 // 3 + 64 * 1024
DEAD_LETTER_HEAD_BYTES = 1024  # how much of a refused entry is kept, to see what sent it


class EntryRefused(ValueError):
    """A raw queue entry that is not a message kombu can hand to a consumer."""


def admit_entry(raw: bytes) -> dict:
    """kombu's envelope from one raw queue entry, checked cheapest first: the size on the raw bytes, then
    the JSON, then each field kombu reads before a consumer sees the message (a missing or mistyped one
    would raise inside kombu's event loop and end the worker). Raises EntryRefused naming the problem."""
    if len(raw) > MAX_ENTRY_BYTES:
        raise EntryRefused(f"entry of {len(raw)} bytes exceeds the limit of {MAX_ENTRY_BYTES} bytes")
    try:
        payload = _json_loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise EntryRefused(f"not JSON: {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(payload, dict):
        raise EntryRefused(f"not a kombu envelope: a JSON {type(payload).__name__}")
    props = payload.get("properties")
    if not isinstance(props, dict):
        raise EntryRefused("not a kombu envelope: no 'properties' object")
    if not isinstance(props.get("delivery_tag"), (str, int)) or isinstance(props.get("delivery_tag"), bool):
        raise EntryRefused("not a kombu envelope: no string or integer 'properties.delivery_tag'")
    info = props.get("delivery_info")
    if not isinstance(info, dict) or not all(isinstance(info.get(k, ""), str) for k in ("exchange", "routing_key")):
        raise EntryRefused("not a kombu envelope: no 'properties.delivery_info' object")
    for key in ("headers",):
        if payload.get(key) is not None and not isinstance(payload[key], dict):
            raise EntryRefused(f"not a kombu envelope: '{key}' is not an object")
    for key in ("content-type", "content-encoding"):
        if payload.get(key) is not None and not isinstance(payload[key], str):
            raise EntryRefused(f"not a kombu envelope: '{key}' is not a string")
    body, encoding = payload.get("body"), props.get("body_encoding")
    if body is not None and not isinstance(body, str):
        raise EntryRefused("not a kombu envelope: 'body' is not a string")
    if encoding not in (None, "base64"):
        raise EntryRefused(f"not a kombu envelope: unknown body encoding {str(encoding)[:40]!r}")
    if encoding == "base64" and body:
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise EntryRefused("not a kombu envelope: the body is not base64") from None
    return payload


class GuardedRedisChannel(RedisChannel):
    """kombu's Redis channel, whose every popped entry passes `admit_entry` before kombu parses it; a
    refused entry is dead-lettered with its queue's name, and the worker takes the next one."""

    def _brpop_read(self, **options):
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next poll reconnects
                raise
            if not reply:
                raise Empty()
            key, raw = reply
            queue = key.decode() if isinstance(key, bytes) else str(key)
            queue = queue.rsplit(self.sep, 1)[0]  # a priority step's key names its queue first
            self._queue_cycle.rotate(queue)
            payload = self._admit(raw, queue)
            if payload is not None:
                self.connection._deliver(payload, queue)
            return True
        finally:
            self._in_poll = None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu's own step once a BRPOP reply is read
            if flush is not None:
                flush()

    def _get(self, queue):
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                raw = client.rpop(self._q_for_pri(queue, pri))
                if raw:
                    self._maybe_update_queues_expire(client, queue)
                    payload = self._admit(raw, queue)
                    if payload is None:
                        raise Empty()
                    return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _admit(self, raw: bytes, queue: str) -> dict | None:
        try:
            return admit_entry(raw)
        except EntryRefused as why:
            log.warning("queue %s: an entry of %d bytes refused and dead-lettered: %s", queue, len(raw), why)
            self._dead_letter(queue, str(why), raw)
            return None

    def _dead_letter(self, queue: str, why: str, raw: bytes) -> None:
        try:
            from shared import store

            head = raw[:DEAD_LETTER_HEAD_BYTES].decode("utf-8", "replace")
            with self.conn_or_acquire() as client:
                store.dead_letter(client, queue, f"refused queue entry ({len(raw)} bytes): {why}"[:1000], head)
        except (KombuError, OSError, ValueError) + tuple(self.connection_errors):
            log.warning("could not dead-letter a refused entry of queue %s", queue, exc_info=True)


class GuardedRedisTransport(RedisTransport):
    Channel = GuardedRedisChannel


def exits_if_it_fails(step):
    """A worker's start-up step (a Celery signal handler): Celery logs what such a handler raises and goes on
    consuming, so a lane that could not take its cores, say, would measure anyway. This ends the process
    instead, with the reason in one line, before the worker takes any message."""
    import functools

    from shared.exits import STARTUP_FAILED, exit_now

    @functools.wraps(step)
    def run(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - whatever it was, this worker must not serve
            exit_now(STARTUP_FAILED, log, "start-up failed, exiting: %s: %s", type(err).__name__,
                     str(err).strip().splitlines()[0] if str(err).strip() else "", exc_info=True)

    return run


def make_celery(role: str, redis_url: str | None = None, outage_s: float = 60.0) -> Celery:
    """A Celery app on the Redis broker at `redis_url` (None: given later through use_broker, as a worker does
    once it has read its settings). `outage_s`: how long sending a message waits for a Redis that is away before
    it gives up (the services: their SHARETUNE_REDIS_OUTAGE_S; a client: a minute)."""
    register_capped_json()
    app = Celery(f"sharetune-{role}")
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        event_serializer="json",
        result_accept_content=["json"],
        worker_consumer="services.celery_app:GuardedConsumer",
        task_ignore_result=True,  # results travel through Redis keys the services own (shared.names)
        # crash safety: a message is acknowledged only after its task returns; a worker that dies
        # mid-task leaves it to be delivered again (batches are idempotent: results and records are
        # keyed by content, and poison candidates are capped by their crash count, services.measurer.poison)
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_max_tasks_per_child=MAX_TASKS_PER_CHILD,
        task_default_queue=names.PLAN_QUEUE,
        broker_transport_options={"visibility_timeout": timeouts.VISIBILITY_TIMEOUT_S,
                                  "priority_steps": PRIORITY_STEPS},
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,  # a restarting Redis is waited for, not given up on
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # Flower and `celery inspect` see the workers
        task_send_sent_event=True,
    )
    if redis_url is not None:
        use_broker(app, redis_url, outage_s)
    return app


def use_broker(app: Celery, redis_url: str, outage_s: float = 60.0) -> None:
    """Point `app` at its Redis (a password in the URL is used as given), before it connects: the guarded
    transport on redis:// (other schemes, TLS, sentinel, unix, keep kombu's own), and a sent message waits
    `outage_s` for a Redis that is away."""
    app.conf.broker_url = redis_url
    if redis_url.startswith("redis://"):
        app.conf.broker_transport = f"{__name__}:GuardedRedisTransport"
    app.conf.task_publish_retry_policy = {"max_retries": max(1, int(outage_s)), "interval_start": 0,
                                          "interval_step": 0.5, "interval_max": 1}
