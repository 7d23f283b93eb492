"""The one Celery app factory: JSON only, size-capped, late acknowledgement, one message at a time per
worker; a message a worker refuses to decode (pickle, too large, not JSON) is dead-lettered, not lost
silently.

It lives in `services`, beside the services whose tasks.py use it (and the client, which publishes plan
messages with it), not in `shared`: whatever imports `shared` (the store, the contracts, the API, reports)
then never loads Celery or kombu, and importing this module changes nothing until an app is made."""
from __future__ import annotations

import logging

from celery import Celery
from celery.worker.consumer import Consumer
from kombu.serialization import register
from kombu.utils.json import dumps as _json_dumps
from kombu.utils.json import loads as _json_loads

from shared import names, timeouts
from shared.messages import MAX_MESSAGE_BYTES

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
    """Celery's consumer, plus a dead-letter entry for every message it refuses to decode."""

    def on_decode_error(self, message, exc):
        _dead_letter_refused(self, message, exc)
        super().on_decode_error(message, exc)

    def on_invalid_task(self, body, message, exc):
        _dead_letter_refused(self, message, exc)
        super().on_invalid_task(body, message, exc)


def make_celery(role: str, redis_url: str) -> Celery:
    register_capped_json()
    app = Celery(f"sharetune-{role}", broker=redis_url)  # a password in REDIS_URL is used as given
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
        broker_transport_options={"visibility_timeout": timeouts.VISIBILITY_TIMEOUT_S},
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,  # a restarting Redis is waited for, not given up on
        task_publish_retry_policy={"max_retries": 60, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # Flower and `celery inspect` see the workers
        task_send_sent_event=True,
    )
    return app
