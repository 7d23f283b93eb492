"""A Redis password given in REDIS_URL is honoured by the store and by Celery (a real redis-server)."""
import pytest
import redis

from services.broker.server import EmbeddedRedis
from shared import store
from services.celery_app import make_celery


def test_redis_password_in_the_url_is_honoured(tmp_path):
    with EmbeddedRedis(tmp_path / "redis", password="s3cret-pw") as srv:
        assert "s3cret-pw@" in srv.url
        assert store.connect(srv.url).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=srv.port).ping()
        app = make_celery("test", srv.url)
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            app.send_task("sharetune.nothing", args=[{"x": 1}], queue="security-test", connection=conn)
        assert store.connect(srv.url).llen("security-test") == 1


def test_only_json_is_accepted():
    app = make_celery("test", "redis://127.0.0.1:1/0")
    assert app.conf.accept_content == ["json"] and app.conf.task_serializer == "json"
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost
    assert app.conf.worker_prefetch_multiplier == 1
