"""Any bytes on any queue: the worker that pops them lives on, and the entry is dead-lettered with its queue's
name and the reason, checked on the raw entry before kombu parses it (services.celery_app.admit_entry)."""
from __future__ import annotations

import base64
import json
import time

import psutil
import pytest

from services.celery_app import MAX_ENTRY_BYTES, EntryRefused, admit_entry
from shared import names, store


def _envelope(**over) -> dict:
    env = {"body": base64.b64encode(b"[[], {}, {}]").decode(), "content-encoding": "utf-8",
           "content-type": "application/json", "headers": {"task": "x"},
           "properties": {"delivery_tag": "t1", "body_encoding": "base64",
                          "delivery_info": {"exchange": "", "routing_key": "q"}}}
    env.update(over)
    return env


JUNK = {
    "bytes": b"\x00\xffnot an envelope",
    "json-list": b"[1, 2, 3]",
    "json-object": b'{"hello": "world"}',
    "no-delivery-tag": json.dumps(_envelope(properties={"body_encoding": "base64"})).encode(),
    "bad-base64": json.dumps(_envelope(body="***not base64***")).encode(),
    "odd-encoding": json.dumps(_envelope(properties={"delivery_tag": "t", "body_encoding": "rot13",
                                                     "delivery_info": {}})).encode(),
    "headers-a-list": json.dumps(_envelope(headers=[1])).encode(),
}


def test_a_kombu_envelope_is_admitted_and_each_kind_of_junk_is_refused_with_its_reason():
    assert admit_entry(json.dumps(_envelope()).encode())["headers"] == {"task": "x"}
    reasons = {}
    for kind, raw in JUNK.items():
        with pytest.raises(EntryRefused) as err:
            admit_entry(raw)
        reasons[kind] = str(err.value)
    assert reasons["bytes"].startswith("not JSON")
    assert "a JSON list" in reasons["json-list"]
    assert "'properties'" in reasons["json-object"]
    assert "delivery_tag" in reasons["no-delivery-tag"]
    assert "not base64" in reasons["bad-base64"]
    assert "rot13" in reasons["odd-encoding"]
    assert "'headers'" in reasons["headers-a-list"]


def test_the_size_is_refused_on_the_raw_entry_before_any_parsing():
    with pytest.raises(EntryRefused, match=f"exceeds the limit of {MAX_ENTRY_BYTES} bytes"):
        admit_entry(b"\xff" * (MAX_ENTRY_BYTES + 1))  # not even JSON: the size is checked first


def _dead_letters(redis_conn) -> list[dict]:
    return [json.loads(e) for e in redis_conn.lrange(names.DEADLETTER_KEY, 0, -1)]


def _wait_for_dead_letters(redis_conn, source: str, count: int, since: float, timeout_s: float = 120) -> list:
    deadline = time.time() + timeout_s
    while True:
        mine = [e for e in _dead_letters(redis_conn) if e["source"] == source and e["at"] >= since]
        if len(mine) >= count or time.time() > deadline:
            return mine
        time.sleep(0.2)


@pytest.mark.e2e
def test_junk_on_every_queue_is_dead_lettered_and_no_worker_dies(stack, client, redis_conn):
    queues = [names.PLAN_QUEUE, names.TUNE_QUEUE, names.COSTMODEL_QUEUE] + [lane.queue for lane in client.lanes()]
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    since = time.time()
    for queue in queues:
        for raw in JUNK.values():
            redis_conn.lpush(queue, raw)
    for queue in queues:
        mine = _wait_for_dead_letters(redis_conn, queue, len(JUNK), since)
        assert len(mine) == len(JUNK), f"{queue}: {len(mine)} of {len(JUNK)} junk entries dead-lettered"
        assert all("refused queue entry" in e["why"] for e in mine)
        assert any(e["body"].startswith("\x00\ufffdnot an envelope") for e in mine)  # the raw head, kept
    assert {name: proc.pid for name, proc in stack.procs.items()} == pids, "a worker was restarted"
    assert all(stack.procs[name].poll() is None for name in pids)
    # and they still work: a job runs to the end after the junk
    job = client.submit("tiny", target="llvm", share=client.lanes()[0].share, trials=4, trials_per_iter=4, seed=5)
    assert job.wait(timeout_s=600)["state"] == "done"


@pytest.mark.e2e
def test_the_embedded_store_refuses_a_100_mib_value_and_keeps_every_message_that_fits(stack, redis_conn):
    import redis

    from services.broker.server import CONFIG

    assert MAX_ENTRY_BYTES < int(CONFIG["proto-max-bulk-len"]) < 100 * 1024 * 1024
    # a client that gives up on a hung-up connection after 1 s: the services' client takes a hang-up for a
    # restarting Redis and sends the 100 MiB again and again for its whole outage window (60 s), the same
    # refusal each time
    brief = store.connect(stack.redis_url, outage_s=1.0)
    with pytest.raises((redis.exceptions.ResponseError, redis.exceptions.ConnectionError)):  # Redis hangs up
        brief.lpush("junk-100-mib", b"x" * (100 * 1024 * 1024))
    assert not redis_conn.exists("junk-100-mib")
    assert redis_conn.ping()  # and the server lives on


@pytest.mark.e2e
def test_an_entry_over_the_message_cap_costs_a_lane_no_lasting_memory(stack, client, redis_conn):
    lane = client.lanes()[0]
    name = next(n for n, (queue, _) in stack.agent.lane_procs.items() if queue == lane.queue)
    proc = psutil.Process(stack.procs[name].pid)
    worker = max([proc] + proc.children(recursive=True), key=lambda p: p.memory_info().rss)
    rss_before = worker.memory_info().rss
    since = time.time()
    redis_conn.lpush(lane.queue, b"{" + b" " * MAX_ENTRY_BYTES)  # stored (under Redis's limit), never parsed
    mine = _wait_for_dead_letters(redis_conn, lane.queue, 1, since)
    assert mine and f"exceeds the limit of {MAX_ENTRY_BYTES} bytes" in mine[-1]["why"]
    assert len(mine[-1]["body"]) <= 1024
    time.sleep(1)
    assert worker.is_running() and stack.procs[name].poll() is None
    grown = worker.memory_info().rss - rss_before
    assert grown < 150 * 1024 * 1024, f"the lane kept {grown / 2**20:.0f} MiB after refusing the entry"
    assert redis_conn.llen(lane.queue) == 0  # popped, refused, not left to be popped again
