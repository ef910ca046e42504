"""``tokenmill serve`` against clients that send too much or too slowly, over raw sockets: bodies
past the limit refused before they are read (the server's memory measured in its own process),
uploads streamed through disk and Redis, the API key checked before any body, large JSON parsed
off the event loop, and slow heads and bodies cut off."""

from __future__ import annotations

import hashlib
import json
import select
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.serve_helpers import peak_rss_bytes, read_response, request_head, running_server, serve_process
from tokenmill.serve import body as serve_body

MIB = 1 << 20
HUGE = 100 * MIB
BOUNDARY = "tokenmill-test-boundary"
# Peak memory a refused or streamed 100 MB body may add to the server: an unbounded server adds
# the body at least once (a 64 MiB upload: twice, its bytes and the Redis command that carries them).
MAX_GROWTH = 32 * MIB


def _port(base_url: str) -> int:
    return int(base_url.removesuffix("/v1").rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _multipart_parts(file_bytes: int, chunk: bytes) -> Iterator[bytes]:
    """A /v1/files form (purpose=batch, then a file of ``file_bytes``), piece by piece."""
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
           "Content-Type: application/octet-stream\r\n\r\n").encode()
    for _ in range(file_bytes // len(chunk)):
        yield chunk
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def _send_chunked(sock: socket.socket, pieces: Iterator[bytes]) -> None:
    """Send ``pieces`` as a chunked body, stopping as soon as the server answers or hangs up."""
    for piece in pieces:
        if select.select([sock], [], [], 0)[0]:
            return  # the answer is in: the server stopped reading
        try:
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return
    sock.sendall(b"0\r\n\r\n")


def _head_only(port: int, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    """Send a request head alone and read the answer: it can only come before the body is read."""
    with _connect(port) as sock:
        sock.sendall(request_head("POST", path, headers))
        return read_response(sock)


def _chunked(port: int, path: str, pieces: Iterator[bytes], headers: dict[str, str]) -> tuple[int, Any]:
    with _connect(port) as sock:
        sock.sendall(request_head("POST", path, {"Transfer-Encoding": "chunked", **headers}))
        _send_chunked(sock, pieces)
        status, _, body = read_response(sock)
        return status, body


def _post_json(url: str, body: bytes, timeout_s: float = 30) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _warm_up(port: int) -> None:
    """One small request per route under test, so what they import is in the baseline."""
    assert _post_json(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}") == 400
    status, _ = _chunked(port, "/v1/files", _multipart_parts(MIB, b"y" * MIB),
                         {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert status == 200


def test_a_100_mb_body_is_refused_before_it_is_read(redis_url: str, key_prefix: str) -> None:
    """Declared or chunked, JSON or upload: a 413 in OpenAI's shape, and the server's peak memory
    grows by far less than the body (measured in the server's own process)."""
    with serve_process(redis_url, key_prefix, max_upload_bytes=16 * MIB) as (port, pid):
        _warm_up(port)
        before = peak_rss_bytes(pid)
        for path, content_type in (("/v1/chat/completions", "application/json"),
                                   ("/v1/files", f"multipart/form-data; boundary={BOUNDARY}")):
            status, headers, body = _head_only(port, path, {"Content-Length": str(HUGE), "Content-Type": content_type})
            assert status == 413 and body["error"]["code"] == "request_too_large", (path, body)
            assert headers["x-request-id"]
            pieces = (_multipart_parts(HUGE, b"z" * MIB) if path == "/v1/files"
                      else iter([b"z" * MIB] * (HUGE // MIB)))
            status, body = _chunked(port, path, pieces, {"Content-Type": content_type})
            assert status == 413 and body["error"]["code"] == "request_too_large", (path, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
        grown = peak_rss_bytes(pid) - before
    assert grown < MAX_GROWTH, f"serve's peak RSS grew by {grown / MIB:.1f} MiB"


def test_an_upload_streams_through_disk_and_redis(redis_url: str, key_prefix: str) -> None:
    """A 64 MiB file goes up and comes back byte for byte, never whole in the server's memory."""
    data = hashlib.sha256(b"seed").digest() * (64 * MIB // 32)
    with serve_process(redis_url, key_prefix) as (port, pid), \
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x") as client:
        _warm_up(port)
        before = peak_rss_bytes(pid)
        uploaded = client.files.create(file=("big.jsonl", data), purpose="batch")
        assert uploaded.bytes == len(data)
        with client.files.with_streaming_response.content(uploaded.id) as response:
            digest = hashlib.sha256()
            for chunk in response.iter_bytes():
                digest.update(chunk)
        grown = peak_rss_bytes(pid) - before
        assert client.files.delete(uploaded.id).deleted
    assert digest.digest() == hashlib.sha256(data).digest()
    assert grown < MAX_GROWTH, f"serve's peak RSS grew by {grown / MIB:.1f} MiB"


def test_the_api_key_is_checked_before_the_body(redis_url: str, key_prefix: str) -> None:
    """A 300 MB upload or batch without a valid key gets its 401 from the head alone; with the key,
    the body limit answers, again before a byte of the body."""
    with running_server(redis_url, key_prefix, api_keys=["sk-right"]) as url:
        port = _port(url)
        for path in ("/v1/files", "/v1/batches", "/v1/chat/completions"):
            for auth in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
                status, headers, body = _head_only(port, path, {"Content-Length": str(300 * MIB), **auth})
                assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, auth)
                assert headers["x-request-id"]
            status, _ = _chunked(port, path, iter([b"{" * MIB] * 300), {})
            assert status == 401
            status, _, body = _head_only(port, path, {"Content-Length": str(300 * MIB),
                                                      "Authorization": "Bearer sk-right"})
            assert status == 413 and body["error"]["code"] == "request_too_large"


def test_a_large_body_is_parsed_off_the_event_loop(redis_url: str, key_prefix: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """While a large body's parse is held, a small request is answered: the parse runs in a thread.
    (Parsed on the event loop, the held parse would stall the small request until the guard below.)"""
    parsing, release = threading.Event(), threading.Event()
    parse = serve_body.parse_json

    def held_parse(raw: bytes) -> Any:
        if len(raw) > serve_body.THREAD_PARSE_BYTES:
            parsing.set()
            assert release.wait(timeout=60)
        return parse(raw)

    monkeypatch.setattr(serve_body, "parse_json", held_parse)
    order: list[str] = []
    large = json.dumps({"model": "echo", "messages": "x" * (2 * serve_body.THREAD_PARSE_BYTES)}).encode()
    with running_server(redis_url, key_prefix) as url:
        def post_large() -> None:
            assert _post_json(f"{url}/chat/completions", large) == 400  # messages must be a list
            order.append("large")

        thread = threading.Thread(target=post_large)
        thread.start()
        try:
            assert parsing.wait(timeout=30)
            assert _post_json(f"{url}/chat/completions", b'{"model": "echo", "messages": "hi"}', timeout_s=20) == 400
            order.append("small")
        finally:
            release.set()
            thread.join(timeout=30)
    assert order == ["small", "large"]


def test_slow_heads_are_cut_off(redis_url: str, key_prefix: str) -> None:
    """A connection that sends no head, half a head, or half of its next head after a response, is
    closed (``serve.header_timeout_s``); a prompt client is served meanwhile."""
    with running_server(redis_url, key_prefix, header_timeout_s=0.3) as url:
        port = _port(url)
        silent = [_connect(port) for _ in range(20)]
        halves = [_connect(port) for _ in range(20)]
        for sock in halves:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        with _connect(port) as kept:
            kept.sendall(request_head("GET", "/health"))
            assert read_response(kept)[0] == 200
            kept.sendall(b"GET /health HTTP/1.1\r\n")
            assert kept.recv(1) == b"", "the connection was closed"
        with urllib.request.urlopen(f"{url}/models", timeout=10) as response:
            assert response.status == 200
        for sock in silent + halves:
            with sock:
                assert sock.recv(1) == b"", "the connection was closed"


def test_a_slow_body_gets_a_408(redis_url: str, key_prefix: str) -> None:
    with running_server(redis_url, key_prefix, body_timeout_s=0.3) as url:
        port = _port(url)
        with _connect(port) as sock:
            sock.sendall(request_head("POST", "/v1/chat/completions", {"Content-Length": "100"}) + b'{"model": ')
            status, headers, body = read_response(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout" and headers["x-request-id"]
    assert "serve.body_timeout_s" in body["error"]["message"]
