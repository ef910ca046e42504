"""The dashboard in a real Chromium (Debian's, through Playwright; tests/browser.py), against ``tokenmill serve``, a
real Redis and a real echo worker: what Redis holds is on the page, progress moves, changes work from the page, and
no key shows nothing. Each view's screenshot is written under the test's temp folder (and ``$TOKENMILL_SCREENSHOTS_DIR``
when set: docs/dashboard/ holds the README's)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.browser import chromium_path, screenshot
from tests.processes import scaled_s
from tests.serve_helpers import running_server
from tests.worker_helpers import add_dead_letter, enqueue, make_settings, running_worker, wait_result
from tokenmill.producer import bulk, eta
from tokenmill.producer.bulk import pipeline
from tokenmill.producer.client import Producer
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.rates import ADDED, OUT, RATE_TTL_S, TOKENS, field, minute_of
from tokenmill.protocol.schema import GenerationRequest, encode_request

pytestmark = pytest.mark.e2e
READER, ADMIN = "reader-key", "admin-key"
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


@pytest.fixture
def worker_name(redis_url: str, key_prefix: str) -> Iterator[str]:
    """A real echo worker, paced (a long request runs for seconds: there is time to watch and cancel it)."""
    settings = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.05", name="echo-1",
                             engine={"scheduler": {"max_num_seqs": 4}})
    with running_worker(settings):
        yield settings.worker.name


@pytest.fixture
def dashboard(redis_url: str, key_prefix: str) -> Iterator[str]:
    with running_server(redis_url, key_prefix, api_keys=[READER], admin_api_keys=[ADMIN]) as base:
        yield base.removesuffix("/v1") + "/dashboard"


def waiting(client: redis.Redis, keys: Keys, lane: int) -> None:
    """A request naming a model no worker serves: it waits in that model's lane (as a producer queues it)."""
    client.sadd(keys.models, "llama-70b")
    request = GenerationRequest(prompt="wait", model="llama-70b", priority=lane)
    client.xadd(keys.lane(lane, "llama-70b"), encode_request(request))  # type: ignore[arg-type]


def an_hour_of_counters(client: redis.Redis, keys: Keys) -> None:
    """What workers and dashboards would have written over the last hour (protocol/rates.py): a day-shaped load on
    the shared lane 1."""
    now_s = float(client.time()[0])
    current = minute_of(now_s)
    pipe = client.pipeline(transaction=False)
    minutes = range(current - 60, current)
    added = [int(2500 * (1.0 + 0.8 * math.sin((minute - current + 4) / 9))) for minute in minutes]
    total = -sum(added)  # the lane's counter reaches today's value (0 here) at the start of this minute
    for minute, new in zip(minutes, added):
        done = int(new * 0.97)
        pipe.hincrby(keys.rates(minute), field(OUT, keys.lane(1)), done)
        pipe.hincrby(keys.rates(minute), field(TOKENS, keys.lane(1)), done * 180)
        pipe.hsetnx(keys.rates(minute), field(ADDED, keys.lane(1)), f"{minute * 60_000}:{total}")
        total += new
        pipe.hincrby(keys.worker_rates(minute), field(OUT, "echo-1"), done)
        pipe.hincrby(keys.worker_rates(minute), field(TOKENS, "echo-1"), done * 180)
        pipe.expire(keys.rates(minute), RATE_TTL_S)
        pipe.expire(keys.worker_rates(minute), RATE_TTL_S)
    pipe.execute()


def signed_in(browser: Any, dashboard: str, key: str, **context: Any) -> Any:
    """A new page signed in with ``key`` through the sign-in form."""
    page = browser.new_context(**context).new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    page.set_default_timeout(scaled_s(WAIT_MS / 1000) * 1000)
    response = page.goto(dashboard + "/login")
    assert response is not None and response.status == 200
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url(dashboard)
    return page


def test_overview_shows_the_lane_depths_and_worker_rows_redis_holds(browser: Any, dashboard: str, worker_name: str,
                                                                    keys: Keys, redis_client: redis.Redis,
                                                                    tmp_path: Path) -> None:
    """Requests naming a model no worker serves wait in its lanes while the echo worker runs beside them."""
    for lane in (1, 1, 1, 1, 1, 1, 1, 0):
        waiting(redis_client, keys, lane)
    an_hour_of_counters(redis_client, keys)
    page = signed_in(browser, dashboard, ADMIN, viewport={"width": 1360, "height": 900})
    lane_1 = page.locator(f'tr[data-stream="{keys.lane(1, "llama-70b")}"] td[data-depth]')
    assert lane_1.inner_text() == "7" and redis_client.xlen(keys.lane(1, "llama-70b")) == 7
    assert page.locator(f'tr[data-stream="{keys.lane(0, "llama-70b")}"] td[data-depth]').inner_text() == "1"
    row = page.locator(f'tr[data-worker="{worker_name}"]')
    assert "running" in row.inner_text() and "echo" in row.inner_text()
    assert page.locator('[data-kpi="depth"]').inner_text() == "8"
    assert page.locator("svg.chart polyline").count() >= 3  # in, out and tokens over the hour the counters hold
    screenshot(page, tmp_path, "overview")
    waiting(redis_client, keys, 1)  # the page refreshes in place, no reload
    cell = f'tr[data-stream="{keys.lane(1, "llama-70b")}"] td[data-depth]'
    page.wait_for_function(f"() => document.querySelector('{cell}').textContent.trim() === '8'")
    page.goto(dashboard + "/workers")
    assert worker_name in page.locator("table.workers").inner_text()
    screenshot(page, tmp_path, "workers")
    page.goto(dashboard + f"/workers/{worker_name}")
    screenshot(page, tmp_path, "worker")
    narrow = signed_in(browser, dashboard, ADMIN, viewport={"width": 390, "height": 844}, color_scheme="dark")
    assert narrow.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")  # no sideways scroll
    screenshot(narrow, tmp_path, "overview-narrow-dark")


def test_a_bulk_jobs_progress_bar_and_eta_move_as_rows_finish(browser: Any, dashboard: str, worker_name: str,
                                                              producer: Producer, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "ETA_INTERVAL_S", 0.5)  # NOTE: the job renews its ETA often in a short test,
    monkeypatch.setattr(eta, "MIN_RATE_SPAN_S", 1.0)  # and measures its own rate sooner
    source = tmp_path / "in.jsonl"
    rows = [json.dumps({"id": f"r{i}", "prompt": f"row {i}", "max_tokens": 80, "ignore_eos": True}) for i in range(60)]
    source.write_text("\n".join([*rows, '{"id": "broken", "prompt": "x", "temperature": -3}']) + "\n")
    job = threading.Thread(target=bulk.run, args=(source, tmp_path / "out.jsonl"), kwargs={"producer": producer})
    job.start()
    page = signed_in(browser, dashboard, ADMIN, viewport={"width": 1280, "height": 800})
    page.goto(dashboard + "/jobs")
    page.wait_for_selector("tr[data-job] progress")
    page.click("tr[data-job] a")
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + scaled_s(60)
    while time.monotonic() < deadline:
        done = int(page.locator("[data-done]").get_attribute("data-done") or 0)
        eta_s = page.locator(".kpi [data-eta]").get_attribute("data-eta") or ""
        if not seen or seen[-1] != (done, eta_s):
            seen.append((done, eta_s))
        if 0 < done < 61 and eta_s not in ("", "None") and len(seen) == 4:
            screenshot(page, tmp_path, "job")
        if done == 61:
            break
        time.sleep(0.2)
    job.join(timeout=30)
    progress = [done for done, _ in seen]
    etas = [eta_s for _, eta_s in seen if eta_s not in ("", "None")]
    assert progress == sorted(progress) and len(set(progress)) >= 3 and progress[-1] == 61, seen
    assert len(set(etas)) >= 2, seen  # the ETA moved as rows finished
    page.wait_for_selector("td .chip:text('invalid')")
    assert "broken" in page.locator("table").last.inner_text()
    page.goto(dashboard + "/jobs")
    screenshot(page, tmp_path, "jobs")


def test_a_requests_page_shows_its_text(browser: Any, dashboard: str, worker_name: str, producer: Producer,
                                        tmp_path: Path) -> None:
    request_id = producer.submit(prompt="Name three rivers.", max_tokens=12, raw=True)
    text = producer.result(request_id, timeout=scaled_s(30)).text
    page = signed_in(browser, dashboard, READER)
    page.fill("input[name=id]", request_id)
    page.press("input[name=id]", "Enter")
    page.wait_for_selector("[data-result-text]")
    assert page.locator("[data-result-text]").inner_text() == text and text
    assert page.locator("[data-status]").get_attribute("data-status") == "finished"
    assert worker_name in page.locator(".facts").inner_text()
    screenshot(page, tmp_path, "request")


def test_a_dead_letter_is_replayed_and_then_answered(browser: Any, dashboard: str, worker_name: str, keys: Keys,
                                                     redis_client: redis.Redis, tmp_path: Path) -> None:
    add_dead_letter(redis_client, keys, "revive-me")
    redis_client.xadd(keys.dead, {"reason": "undecodable", "stream": keys.lane(0), "entry_id": "1-0", "d": b"\xc1"})
    page = signed_in(browser, dashboard, ADMIN, viewport={"width": 1280, "height": 800})
    page.goto(dashboard + "/dead")
    row = page.locator("tr[data-dead-id]", has_text="revive-me")
    screenshot(page, tmp_path, "dead-letters")
    row.locator("button", has_text="Replay").click()
    page.wait_for_selector("#toast.show")
    assert "Replayed 1" in page.locator("#toast").inner_text()
    result = wait_result(redis_client, keys, "revive-me", timeout_s=30)
    assert result.ok and result.text
    page.goto(dashboard + "/requests/revive-me")
    assert page.locator("[data-status]").get_attribute("data-status") == "finished"
    assert redis_client.xlen(keys.dead) == 1  # the other letter stays
    assert "replay" in redis_client.xrevrange(keys.audit, count=1)[0][1][b"action"].decode()


def test_cancel_stops_a_running_request(browser: Any, dashboard: str, worker_name: str, producer: Producer,
                                        keys: Keys, redis_client: redis.Redis, tmp_path: Path) -> None:
    request_id = producer.submit(prompt="x" * 20, max_tokens=1500, ignore_eos=True, stream_tokens=True, raw=True)
    page = signed_in(browser, dashboard, ADMIN, viewport={"width": 1280, "height": 800})
    page.goto(dashboard + f"/requests/{request_id}")
    page.wait_for_selector("[data-status='running'] >> nth=0")
    page.wait_for_selector("[data-stream-text]")
    screenshot(page, tmp_path, "request-running")
    page.click("button:text('Cancel request')")
    page.wait_for_selector("[data-status='cancelled']", timeout=scaled_s(30) * 1000)
    result = wait_result(redis_client, keys, request_id, timeout_s=10)
    assert result.status == "cancelled" and len(result.token_ids) < 1500


def test_without_a_key_the_page_and_its_data_answer_401(browser: Any, dashboard: str, keys: Keys,
                                                        redis_client: redis.Redis, tmp_path: Path) -> None:
    enqueue(redis_client, keys, lane=1)
    page = browser.new_context().new_page()
    for path in ("", "/workers", "/jobs", "/dead"):
        response = page.goto(dashboard + path)
        assert response is not None and response.status == 401
        assert page.locator("input[name=key]").is_visible() and keys.base not in page.content()
    for path in ("/api/overview", "/api/workers", "/api/jobs", "/api/dead"):
        status = page.evaluate(f"fetch('{dashboard}{path}').then(r => r.status)")
        assert status == 401
    screenshot(page, tmp_path, "sign-in")


def test_a_read_only_key_cannot_replay(browser: Any, dashboard: str, keys: Keys, redis_client: redis.Redis) -> None:
    add_dead_letter(redis_client, keys, "keep-dead")
    page = signed_in(browser, dashboard, READER)
    page.goto(dashboard + "/dead")
    assert page.locator("tr[data-dead-id]", has_text="keep-dead").is_visible()
    assert page.locator("button", has_text="Replay").count() == 0
    dead_id = redis_client.xrange(keys.dead)[0][0].decode()
    status = page.evaluate("""async (id) => (await fetch('/dashboard/api/dead/replay', {method: 'POST',
        headers: {'Content-Type': 'application/json',
                  'X-CSRF-Token': document.querySelector('meta[name=csrf-token]').content},
        body: JSON.stringify({ids: [id]})})).status""", dead_id)
    assert status == 403 and redis_client.xlen(keys.dead) == 1
