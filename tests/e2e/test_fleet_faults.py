"""Faults in a fleet of prefill and decode workers (tiny random model, float64, real Redis): a prefill or a decode
worker killed mid-run (SIGKILL), Redis itself killed and restarted, a fleet store too small for the blocks in
flight, and a connection lost right after a read. Every request is answered exactly once, with the tokens one engine
alone computes for it, and no prompt block a decode worker computed instead of fetching goes uncounted: a decode
engine's handed-off requests' full prompt blocks are exactly those its prefix cache held at their admission (local,
or loaded from the fleet's store) plus ``handoff_recomputed_blocks``."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.engine_helpers import build_engine
from tests.processes import scaled_s
from tests.worker_helpers import enqueue, make_settings, running_worker, start_worker_process, wait_until
from tokenmill.engine.core.stats import EngineStats
from tokenmill.protocol.embedded_redis import server_binary
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.schema import decode_result
from tokenmill.worker.runtime import Worker

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 48
MAX_TOKENS = 24
BLOCK_SIZE = 4
SHARED_TOKENS = 64  # every prompt starts with these (16 blocks)...
UNIQUE_TOKENS = 40  # ...then has its own (10 blocks)
# NOTE: the full blocks of a prompt the fleet cache accounts for: its last token is always computed (the logits).
BLOCKS_PER_PROMPT = (SHARED_TOKENS + UNIQUE_TOKENS - 1) // BLOCK_SIZE
WAIT_S = 60.0
ENGINE: dict[str, dict[str, Any]] = {
    "model": {"device": "cpu", "dtype": "float64", "max_model_len": 512},
    "cache": {"kv_cache_memory": "4MiB", "block_size": BLOCK_SIZE},  # 1024 blocks: room for every request at once
    "fleet_cache": {"enabled": True, "min_blocks": 1},
}
# A worker process to be killed: it steps two requests at once, so it is still busy when the test kills it.
VICTIM_ENV = {"TOKENMILL_ENGINE__FLEET_CACHE__ENABLED": "true", "TOKENMILL_ENGINE__FLEET_CACHE__MIN_BLOCKS": "1",
              "TOKENMILL_ENGINE__MODEL__DEVICE": "cpu", "TOKENMILL_ENGINE__MODEL__DTYPE": "float64",
              "TOKENMILL_ENGINE__MODEL__MAX_MODEL_LEN": "512", "TOKENMILL_ENGINE__MODEL__NUM_THREADS": "1",
              "TOKENMILL_ENGINE__CACHE__BLOCK_SIZE": str(BLOCK_SIZE),
              "TOKENMILL_ENGINE__CACHE__KV_CACHE_MEMORY": "4MiB", "TOKENMILL_ENGINE__SCHEDULER__MAX_NUM_SEQS": "2"}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 384) for _ in range(SHARED_TOKENS)]
    return [shared + [rng.randrange(3, 384) for _ in range(UNIQUE_TOKENS)] for _ in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """The tokens one engine alone (no fleet cache) generates for each prompt, and the bytes of its KV block."""
    offline = build_engine(str(model_dir), device="cpu", dtype="float64", kv_cache_memory="4MiB",
                           block_size=BLOCK_SIZE, max_model_len=512)
    try:
        outputs = offline.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), progress=False)
        block_bytes = offline.stats().kv_block_bytes
    finally:
        offline.close()
    return [out.token_ids for out in outputs], block_bytes


@pytest.fixture(scope="module")
def expected(reference: tuple[list[list[int]], int]) -> list[list[int]]:
    return reference[0]


class RestartableRedis:
    """A redis-server of the test's own on a unix socket, its append-only file fsynced at every write: killed
    (SIGKILL, a crash) and started again on the same socket, it comes back with every write it acknowledged."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "redis.sock"
        self.url = f"unix://{self.socket}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [str(server_binary()), "--port", "0", "--unixsocket", str(self.socket), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + scaled_s(10)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class DropsOneCancelCheck(redis.Redis):
    """A client whose first ZMSCORE (the reader's cancellation check of what it just read) fails as a lost
    connection does: the entries were delivered, the worker has not dispatched them yet."""

    has_failed = False

    def zmscore(self, *args: Any, **kwargs: Any) -> Any:
        if not self.has_failed:
            self.has_failed = True
            raise redis.ConnectionError("the connection was lost (the test's)")
        return super().zmscore(*args, **kwargs)


def _settings(redis_url: str, prefix: str, model_dir: Path, name: str, role: str,
              fleet_cache: dict[str, Any] | None = None, max_num_seqs: int = 8, **worker: Any) -> Any:
    engine = {**ENGINE, "fleet_cache": {**ENGINE["fleet_cache"], **(fleet_cache or {})},
              "scheduler": {"max_num_seqs": max_num_seqs}}
    return make_settings(redis_url, prefix, model=str(model_dir), engine=engine, name=name, role=role,
                         max_waiting=4, **worker)


def _start_victim(redis_url: str, prefix: str, model_dir: Path, name: str, role: str) -> subprocess.Popen[bytes]:
    """A worker process of ``role``, once its heartbeat is in."""
    process = start_worker_process(redis_url, prefix, name, "--role", role, "--max-waiting", "2",
                                   model=str(model_dir), env=VICTIM_ENV)
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + scaled_s(WAIT_S)
        while not client.hexists(Keys(prefix).workers, name):
            if process.poll() is not None:
                raise AssertionError(f"{name} exited: {process.stderr.read().decode() if process.stderr else ''}")
            assert time.monotonic() < deadline, f"{name} did not start"
            time.sleep(0.05)
    finally:
        client.close()
    return process


def _kill(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    if process.stderr is not None:
        process.stderr.close()


def _enqueue_all(client: redis.Redis, keys: Keys, prompts: list[list[int]], reply: str,
                 max_tokens: list[int] | None = None) -> list[str]:
    """One request per prompt, over every priority lane (so over every decode lane too)."""
    max_tokens = max_tokens or [MAX_TOKENS] * len(prompts)
    return [enqueue(client, keys, i % keys.num_lanes, prompt=None, prompt_token_ids=prompt, reply_to=reply,
                    params={"max_tokens": num_tokens, "ignore_eos": True})
            for i, (prompt, num_tokens) in enumerate(zip(prompts, max_tokens, strict=True))]


def _num_results(client: redis.Redis, keys: Keys, ids: list[str]) -> int:
    return sum(client.exists(keys.result(rid)) for rid in ids)


def _num_handed_off(client: redis.Redis, keys: Keys, ids: list[str]) -> int:
    """Requests handed to the decode pool so far: those in its lanes and those answered (a decode worker's finish
    stores the result and deletes the entry in one step)."""
    in_decode_lanes = sum(client.xlen(keys.lane(k, is_decode=True)) for k in range(keys.num_lanes))
    return _num_results(client, keys, ids) + in_decode_lanes


def _num_pending_of(client: redis.Redis, keys: Keys, consumer: str, is_decode: bool) -> int:
    streams = [keys.lane(k, is_decode=is_decode) for k in range(keys.num_lanes)]
    return sum(len(client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 1000, consumername=consumer))
               for stream in streams if client.exists(stream))


def _kill_mid_run(victim: subprocess.Popen[bytes], client: redis.Redis, keys: Keys, name: str,
                  num_done: Callable[[], int], is_decode: bool = False) -> None:
    """SIGKILL the worker process ``victim`` (consumer ``name`` of the decode lanes, or of the request lanes) once
    ``num_done`` requests have passed its part (6), and check it died mid-run, holding entries."""
    try:
        wait_until(lambda: num_done() >= 6, timeout_s=WAIT_S, poll_s=0.01)
    finally:
        _kill(victim)
    assert num_done() < NUM_REQUESTS, f"{name} did its part of every request before it died"
    assert _num_pending_of(client, keys, name, is_decode=is_decode) > 0, f"{name} died holding nothing"


def _assert_answered_once(client: redis.Redis, keys: Keys, ids: list[str], reply: str, expected: list[list[int]],
                          workers: set[str]) -> dict[str, int]:
    """Every request answered ok once, with the reference tokens, by one of ``workers``; nothing left in (or pending
    on) a request or decode lane, nothing dead-lettered.

    Returns:
        How many results each worker wrote.
    """
    wait_until(lambda: _num_results(client, keys, ids) == len(ids), timeout_s=WAIT_S)
    by_worker: dict[str, int] = {}
    for rid, tokens in zip(ids, expected, strict=True):
        result = decode_result(client.get(keys.result(rid)))  # type: ignore[arg-type]
        assert result.status == "ok", result
        assert result.token_ids == tokens, rid
        assert result.worker in workers, result.worker
        by_worker[result.worker] = by_worker.get(result.worker, 0) + 1
    entries: Any = client.xrange(reply)
    replied = [decode_result(fields[b"d"]).id for _, fields in entries]
    assert sorted(replied) == sorted(ids), "the reply stream has duplicates or gaps"
    for k in range(keys.num_lanes):
        for stream in (keys.lane(k), keys.lane(k, is_decode=True)):
            assert client.xlen(stream) == 0, stream
            if client.exists(stream):
                assert sum(group["pending"] for group in client.xinfo_groups(stream)) == 0, stream
    assert client.xlen(keys.dead) == 0
    return by_worker


def _stats(worker: Worker) -> EngineStats:
    return worker._engine.stats()  # the test reads the engine's own counters, once the worker is idle


def _assert_handoffs_accounted(stats: EngineStats, num_handoffs: int | None = None) -> None:
    """A decode engine's books: the full prompt blocks of every request handed to it were found in its prefix cache
    at admission, or computed and counted in ``handoff_recomputed_blocks``."""
    fleet = stats.fleet
    if num_handoffs is not None:
        assert fleet.num_handoffs == num_handoffs, fleet
    # NOTE: a request preempted by recompute is admitted again and counts its hits twice (a swapped one does not).
    assert stats.counters.num_recompute_preemptions == 0
    cached_blocks, remainder = divmod(stats.prefix.num_hit_tokens, BLOCK_SIZE)
    assert remainder == 0
    assert fleet.num_handoffs * BLOCKS_PER_PROMPT == cached_blocks + fleet.handoff_recomputed_blocks, \
        (fleet, stats.prefix)


def test_prefill_worker_killed_mid_run_a_replacement_prefills_what_it_held(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, model_dir: Path, prompts: list[list[int]],
        expected: list[list[int]]) -> None:
    keys = Keys(key_prefix)
    reply = keys.reply("prefill-killed")
    with running_worker(_settings(redis_url, key_prefix, model_dir, "decode", "decode")) as decode:
        ids = _enqueue_all(redis_client, keys, prompts, reply)
        victim = _start_victim(redis_url, key_prefix, model_dir, "prefill-victim", "prefill")
        _kill_mid_run(victim, redis_client, keys, "prefill-victim", lambda: _num_handed_off(redis_client, keys, ids))
        with running_worker(_settings(redis_url, key_prefix, model_dir, "prefill-heir", "prefill")) as heir:
            by_worker = _assert_answered_once(redis_client, keys, ids, reply, expected, workers={"decode"})
            decoded, prefilled = _stats(decode), _stats(heir)
    assert by_worker == {"decode": NUM_REQUESTS}
    # Each request was handed off once: by the victim, or by its heir (those the victim held once reclaimed).
    _assert_handoffs_accounted(decoded, num_handoffs=NUM_REQUESTS)
    # NOTE: a prefill worker hands a request off only once its blocks are published: the decode worker missed none.
    assert decoded.fleet.handoff_recomputed_blocks == 0, decoded.fleet
    assert decoded.fleet.num_fallbacks == 0, decoded.fleet.fallbacks
    assert prefilled.fleet.num_publish_errors == 0


def test_decode_worker_killed_mid_run_another_reclaims_its_decode_entries(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, model_dir: Path, prompts: list[list[int]],
        expected: list[list[int]]) -> None:
    keys = Keys(key_prefix)
    reply = keys.reply("decode-killed")
    with running_worker(_settings(redis_url, key_prefix, model_dir, "prefill", "prefill")):
        victim = _start_victim(redis_url, key_prefix, model_dir, "decode-victim", "decode")
        ids = _enqueue_all(redis_client, keys, prompts, reply)
        _kill_mid_run(victim, redis_client, keys, "decode-victim", lambda: _num_results(redis_client, keys, ids),
                      is_decode=True)
        with running_worker(_settings(redis_url, key_prefix, model_dir, "decode-heir", "decode")) as heir:
            by_worker = _assert_answered_once(redis_client, keys, ids, reply, expected,
                                              workers={"decode-victim", "decode-heir"})
            decoded = _stats(heir)
    assert by_worker["decode-victim"] >= 6 and by_worker["decode-heir"] >= 1, by_worker
    # The heir admitted each request it answered once (those the victim held, reclaimed, and the rest).
    _assert_handoffs_accounted(decoded, num_handoffs=by_worker["decode-heir"])
    assert decoded.fleet.handoff_recomputed_blocks == 0, decoded.fleet


def test_redis_killed_and_restarted_mid_run(restartable_redis: RestartableRedis, model_dir: Path,
                                            prompts: list[list[int]], expected: list[list[int]]) -> None:
    url = restartable_redis.url
    keys = Keys("restart")
    reply = keys.reply("restart")
    client = redis.Redis.from_url(url)
    with ExitStack() as stack:
        prefill = stack.enter_context(running_worker(_settings(url, keys.prefix, model_dir, "prefill", "prefill",
                                                               max_num_seqs=2)))
        decode = stack.enter_context(running_worker(_settings(url, keys.prefix, model_dir, "decode", "decode")))
        ids = _enqueue_all(client, keys, prompts, reply)
        wait_until(lambda: _num_handed_off(client, keys, ids) >= 6, timeout_s=WAIT_S, poll_s=0.01)
        client.close()
        restartable_redis.kill()
        time.sleep(1.0)  # NOTE: both workers compute what they hold meanwhile: publishes and lookups fail
        restartable_redis.start()
        client = stack.enter_context(redis.Redis.from_url(url))
        by_worker = _assert_answered_once(client, keys, ids, reply, expected, workers={"decode"})
        prefilled, decoded = _stats(prefill), _stats(decode)
    assert by_worker == {"decode": NUM_REQUESTS}
    # The outage is counted, not silent: the publishes that failed, and the blocks the decode worker computed
    # for want of them.
    assert prefilled.fleet.num_publish_errors >= 1, prefilled.fleet
    assert decoded.fleet.num_handoffs >= NUM_REQUESTS  # NOTE: a hand-off whose reply was lost may be made twice
    _assert_handoffs_accounted(decoded)
    assert decoded.fleet.handoff_recomputed_blocks > 0, decoded.fleet


def test_a_full_store_drops_blocks_the_decode_worker_recomputes_and_counts(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, model_dir: Path, prompts: list[list[int]],
        reference: tuple[list[list[int]], int]) -> None:
    expected, block_bytes = reference
    keys = Keys(key_prefix)
    reply = keys.reply("store-full")
    # NOTE: six blocks, fewer than any prompt's own ten: each publish evicts its own first blocks, so no decode
    # fetch finds a chain's start. A request of one token finishes in its admission step: counted all the same.
    store = {"max_bytes": 6 * block_bytes}
    max_tokens = [1 if i % 4 == 0 else MAX_TOKENS for i in range(NUM_REQUESTS)]
    prefill_settings = _settings(redis_url, key_prefix, model_dir, "prefill", "prefill", fleet_cache=store)
    decode_settings = _settings(redis_url, key_prefix, model_dir, "decode", "decode", fleet_cache=store)
    with running_worker(prefill_settings), running_worker(decode_settings) as decode:
        ids = _enqueue_all(redis_client, keys, prompts, reply, max_tokens)
        wanted = [tokens[:num_tokens] for tokens, num_tokens in zip(expected, max_tokens, strict=True)]
        by_worker = _assert_answered_once(redis_client, keys, ids, reply, wanted, workers={"decode"})
        decoded = _stats(decode)
    assert by_worker == {"decode": NUM_REQUESTS}
    _assert_handoffs_accounted(decoded, num_handoffs=NUM_REQUESTS)
    assert decoded.fleet.handoff_recomputed_blocks > 0 and decoded.fleet.num_hit_blocks == 0, decoded.fleet
    sizes = [int(size) for key in redis_client.scan_iter(match=f"{key_prefix}:kv:*:sizes")
             for size in redis_client.hvals(key)]
    assert 0 < sum(sizes) <= 6 * block_bytes  # the store never holds more than its cap


def test_a_connection_lost_between_read_and_dispatch_strands_no_handoff(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, model_dir: Path, prompts: list[list[int]],
        expected: list[list[int]]) -> None:
    """What made a Redis restart mid-run lose a request now and then, made to happen every time."""
    keys = Keys(key_prefix)
    reply = keys.reply("lost-connection")
    decode_client = DropsOneCancelCheck.from_url(redis_url)
    assert isinstance(decode_client, DropsOneCancelCheck)
    with running_worker(_settings(redis_url, key_prefix, model_dir, "prefill", "prefill")), \
            running_worker(_settings(redis_url, key_prefix, model_dir, "decode", "decode"), client=decode_client):
        ids = _enqueue_all(redis_client, keys, prompts[:4], reply)
        wait_until(lambda: _num_results(redis_client, keys, ids) == len(ids), timeout_s=10)
        _assert_answered_once(redis_client, keys, ids, reply, expected[:4], workers={"decode"})
    assert decode_client.has_failed
