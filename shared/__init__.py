"""Common package of the sharetune services: contracts, names, settings, the Celery app factory."""
