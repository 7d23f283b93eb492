"""The one Celery app factory: JSON only, late acknowledgement, one message at a time per worker."""
from __future__ import annotations

from celery import Celery

from shared import names

LONGEST_BATCH_S = 3600  # Redis visibility timeout: longer than any measurement batch or tuning job


def make_celery(role: str, redis_url: str) -> Celery:
    app = Celery(f"sharetune-{role}", broker=redis_url)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        event_serializer="json",
        task_ignore_result=True,  # results travel through Redis keys the services own (shared.names)
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue=names.PLAN_QUEUE,
        broker_transport_options={"visibility_timeout": LONGEST_BATCH_S},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # Flower and `celery inspect` see the workers
        task_send_sent_event=True,
    )
    return app
