"""The dashboard over HTTP (no browser): who may see and change what, and that what it shows is what Redis holds
(lanes, workers, rates written by a real echo worker, bulk jobs, dead letters, requests)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from tests.integration.bulk_helpers import write_input
from tests.processes import free_port
from tests.serve_helpers import ROOT, running_server
from tests.worker_helpers import add_dead_letter, enqueue, make_settings, running_worker, wait_result, wait_until
from tokenmill.producer import bulk
from tokenmill.producer.client import Producer
from tokenmill.protocol.keys import Keys

READER, ADMIN = "reader-key", "admin-key"


@pytest.fixture
def dashboard(redis_url: str, key_prefix: str) -> Iterator[str]:
    """``tokenmill serve`` with a read key and an admin key; yields the dashboard's URL."""
    with running_server(redis_url, key_prefix, api_keys=[READER], admin_api_keys=[ADMIN]) as base:
        yield base.removesuffix("/v1") + "/dashboard"


def _client(key: str | None = None) -> requests.Session:
    session = requests.Session()
    if key:
        session.headers["Authorization"] = f"Bearer {key}"
    return session


@pytest.mark.parametrize("path", ["", "/workers", "/jobs", "/dead", "/requests/x1", "/api/overview", "/api/workers",
                                  "/api/jobs", "/api/dead", "/api/requests/x1", "/api/workers/w", "/api/jobs/j"])
def test_without_a_key_pages_and_data_answer_401_and_show_no_lane(dashboard: str, keys: Keys,
                                                                  redis_client: redis.Redis, path: str) -> None:
    enqueue(redis_client, keys, lane=1)
    with _client() as client:
        response = client.get(dashboard + path)
        wrong = client.get(dashboard + path, headers={"Authorization": "Bearer nope"})
    assert response.status_code == wrong.status_code == 401
    assert keys.base not in response.text and "lane" not in response.text.lower()
    if not path.startswith("/api"):
        assert 'name="key"' in response.text  # the sign-in form, nothing else


def test_a_reader_sees_the_lanes_and_the_workers_redis_holds(dashboard: str, redis_url: str, key_prefix: str,
                                                             keys: Keys, redis_client: redis.Redis) -> None:
    for _ in range(3):
        enqueue(redis_client, keys, lane=2)
    with running_worker(make_settings(redis_url, key_prefix, name="w-dash")), _client(READER) as client:
        overview = client.get(dashboard + "/api/overview").json()
        page = client.get(dashboard)
    workers = {row["name"]: row for row in overview["workers"]}
    assert workers["w-dash"]["status"] == "running" and workers["w-dash"]["role"] == "both"
    assert workers["w-dash"]["version"] not in (None, "-")
    assert {lane["lane"] for lane in overview["lanes"]} == {0, 1, 2}
    assert page.status_code == 200 and "w-dash" in page.text and "Content-Security-Policy" in page.headers


def test_depths_and_oldest_age_come_from_the_lanes(dashboard: str, keys: Keys, redis_client: redis.Redis) -> None:
    for _ in range(5):
        enqueue(redis_client, keys, lane=1)
    with _client(READER) as client:
        overview = client.get(dashboard + "/api/overview").json()
    lane = next(row for row in overview["lanes"] if row["lane"] == 1 and row["model"] is None)
    assert lane["depth"] == 5 and lane["oldest_age_s"] is not None and lane["oldest_age_s"] < 60
    assert overview["totals"]["depth"] == 5 and lane["entries_added"] == 5


def test_a_worker_counts_results_and_tokens_per_minute(dashboard: str, redis_url: str, key_prefix: str,
                                                       keys: Keys, redis_client: redis.Redis) -> None:
    with running_worker(make_settings(redis_url, key_prefix, name="w-rate")):
        ids = [enqueue(redis_client, keys, lane=1) for _ in range(4)]
        for request_id in ids:
            wait_result(redis_client, keys, request_id, timeout_s=20)

        def counted() -> bool:
            with _client(READER) as client:
                return bool(client.get(dashboard + "/api/overview").json()["series"]["out_per_s"][-1])

        wait_until(counted, timeout_s=10)
        with _client(READER) as client:
            overview = client.get(dashboard + "/api/overview").json()
            worker = client.get(dashboard + "/api/workers/w-rate").json()
    assert sum(overview["series"]["out_per_s"]) > 0 and sum(overview["series"]["tokens_per_s"]) > 0
    assert sum(worker["series"]["out_per_s"]) > 0
    minute_keys = list(redis_client.scan_iter(match=f"{key_prefix}:default:rate:*"))
    assert minute_keys and all(0 < redis_client.ttl(key) <= 7320 for key in minute_keys)


def test_a_read_only_key_cannot_replay_and_an_admin_key_can(dashboard: str, keys: Keys,
                                                            redis_client: redis.Redis) -> None:
    add_dead_letter(redis_client, keys, "dead-1")
    with _client(READER) as reader, _client(ADMIN) as admin:
        page = reader.get(dashboard + "/api/dead").json()
        dead_id = page["letters"][0]["dead_id"]
        refused = reader.post(dashboard + "/api/dead/replay", json={"ids": [dead_id]})
        assert refused.status_code == 403 and redis_client.xlen(keys.dead) == 1
        replayed = admin.post(dashboard + "/api/dead/replay", json={"ids": [dead_id]})
        assert replayed.status_code == 200, replayed.text
        assert [r["request_id"] for r in replayed.json()["replayed"]] == ["dead-1"]
        changes = admin.get(dashboard + "/dead").text
    assert redis_client.xlen(keys.dead) == 0 and redis_client.xlen(keys.lane(1)) == 1
    assert redis_client.get(keys.result("dead-1")) is None  # the max_deliveries answer went, so the re-run answers
    assert "replay" in changes and redis_client.xlen(keys.audit) == 1


def test_discard_by_reason(dashboard: str, keys: Keys, redis_client: redis.Redis) -> None:
    for n in range(3):
        add_dead_letter(redis_client, keys, f"dead-{n}")
    redis_client.xadd(keys.dead, {"reason": "undecodable", "stream": keys.lane(0), "entry_id": "1-0", "d": b"\xc1"})
    with _client(ADMIN) as admin:
        page = admin.get(dashboard + "/api/dead", params={"reason": "undecodable"}).json()
        assert [letter["reason"] for letter in page["letters"]] == ["undecodable"]
        assert page["reasons"] == {"max_deliveries: delivered 6 times": 3, "undecodable": 1}
        result = admin.post(dashboard + "/api/dead/discard", json={"reason": "max_deliveries: delivered 6 times"})
    assert result.json() == {"discarded": 3} and redis_client.xlen(keys.dead) == 1


def test_a_browser_session_needs_its_csrf_token_to_change_anything(dashboard: str, keys: Keys,
                                                                   redis_client: redis.Redis) -> None:
    add_dead_letter(redis_client, keys, "dead-c")
    with requests.Session() as browser:
        refused = browser.post(dashboard + "/login", data={"key": "guess", "next": "/dashboard"})
        assert refused.status_code == 401 and "not accepted" in refused.text
        signed_in = browser.post(dashboard + "/login", data={"key": ADMIN, "next": "/dashboard/dead"},
                                 allow_redirects=False)
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/dashboard/dead"
        cookie = signed_in.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
        page = browser.get(dashboard + "/dead")
        assert page.status_code == 200 and "dead-c" in page.text
        token = re.search(r'name="csrf-token" content="([^"]+)"', page.text)
        assert token is not None
        dead_id = browser.get(dashboard + "/api/dead").json()["letters"][0]["dead_id"]
        forged = browser.post(dashboard + "/api/dead/replay", json={"ids": [dead_id]})
        assert forged.status_code == 403 and redis_client.xlen(keys.dead) == 1
        done = browser.post(dashboard + "/api/dead/replay", json={"ids": [dead_id]},
                            headers={"X-CSRF-Token": token.group(1)})
        assert done.status_code == 200 and redis_client.xlen(keys.dead) == 0
        browser.post(dashboard + "/logout", data={"csrf": token.group(1)})
        assert browser.get(dashboard + "/api/overview").status_code == 401


def test_a_public_dashboard_shows_data_without_a_key_but_changes_nothing(redis_url: str, key_prefix: str,
                                                                         keys: Keys, redis_client: redis.Redis) -> None:
    add_dead_letter(redis_client, keys, "dead-p")
    with running_server(redis_url, key_prefix, api_keys=[READER], dashboard_public=True) as base, _client() as client:
        url = base.removesuffix("/v1") + "/dashboard"
        assert client.get(url + "/api/overview").status_code == 200
        dead_id = client.get(url + "/api/dead").json()["letters"][0]["dead_id"]
        assert client.post(url + "/api/dead/replay", json={"ids": [dead_id]}).status_code == 403
        assert client.get(url + "/api/overview", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_a_bulk_job_shows_its_progress_and_failed_rows(dashboard: str, tmp_path: Path, redis_url: str,
                                                       key_prefix: str, producer: Producer) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=6)
    with source.open("a") as handle:
        handle.write('{"id": "bad", "prompt": "x", "max_tokens": -1}\n')
    with running_worker(make_settings(redis_url, key_prefix)):
        summary = bulk.run(source, tmp_path / "out.jsonl", producer=producer)
    assert summary.num_ok == 6 and summary.num_invalid == 1
    with _client(READER) as client:
        jobs = client.get(dashboard + "/api/jobs").json()["jobs"]
        assert len(jobs) == 1
        job = jobs[0]
        assert (job["kind"], job["state"], job["total"], job["ok"], job["failed"]) == ("bulk", "done", 7, 6, 1)
        assert job["done"] == 7 and job["progress"] == 1.0 and job["tokens"] > 0
        detail = client.get(dashboard + f"/api/jobs/{job['id']}").json()
        page = client.get(dashboard + f"/jobs/{job['id']}")
    assert [(f["item_id"], f["code"]) for f in detail["failures"]] == [("bad", "invalid")]
    assert page.status_code == 200 and "max_tokens" in page.text


def test_a_request_page_shows_its_result_and_where_a_queued_one_waits(dashboard: str, redis_url: str,
                                                                       key_prefix: str, keys: Keys,
                                                                       redis_client: redis.Redis) -> None:
    waiting = enqueue(redis_client, keys, lane=2, prompt="still waiting")
    with _client(READER) as client:
        info = client.get(dashboard + f"/api/requests/{waiting}").json()
        assert info.get("status") == "waiting", info
        assert info["status"] == "waiting" and info["lane"]["priority"] == 2 and info["lane"]["position"] == 0
        assert info["entry"]["prompt"] == "still waiting" and info["worker"] is None
        with running_worker(make_settings(redis_url, key_prefix)):
            wait_result(redis_client, keys, waiting, timeout_s=20)
        info = client.get(dashboard + f"/api/requests/{waiting}").json()
        page = client.get(dashboard + f"/requests/{waiting}")
        missing = client.get(dashboard + "/api/requests/never-sent").json()
    assert info["status"] == "finished" and info["result"]["text"] and info["result"]["worker"]
    assert info["result"]["text"] in page.text
    assert missing["status"] == "unknown"


def test_tokenmill_dashboard_serves_it_alone(redis_url: str, key_prefix: str) -> None:
    """The command for a fleet without the HTTP front: the same pages and keys, no OpenAI API."""
    port = free_port()
    help_text = subprocess.run([sys.executable, "-m", "tokenmill.cli", "dashboard", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--admin-api-key" in help_text.stdout and "--port" in help_text.stdout
    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix", key_prefix,
                                "dashboard", "--port", str(port), "--api-key", READER, "--log-level", "warning"],
                               cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(base + "/health"), timeout_s=60, poll_s=0.1)
        with _client(READER) as client, _client() as anonymous:
            assert client.get(base + "/dashboard/api/overview").status_code == 200
            assert anonymous.get(base + "/dashboard").status_code == 401
            assert client.get(base + "/v1/models").status_code == 404
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
