"""TokenStreamReader: each byte of a token stream's text comes out once, whatever runs of the request
wrote it (a reclaimed request runs again from the start; a paused worker goes on writing)."""

from __future__ import annotations

from tokenmill.producer.token_stream import TokenStreamReader


def _reply(*entries: dict[bytes, bytes]) -> list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]:
    return [(b"tok", [(f"{i}-0".encode(), fields) for i, fields in enumerate(entries, 1)])]


def _delta(text: str, offset: int) -> dict[bytes, bytes]:
    return {b"t": text.encode(), b"o": str(offset).encode()}


def _read(*entries: dict[bytes, bytes]) -> str:
    return "".join(TokenStreamReader().feed(_reply(*entries)))


def test_a_second_run_from_the_start_adds_only_what_the_first_had_not_written() -> None:
    first = [_delta("Hel", 0), _delta("lo", 3)]
    second = [_delta("H", 0), _delta("ello", 1), _delta(" world", 5)]
    assert _read(*first, *second, {b"end": b"1"}) == "Hello world"


def test_a_paused_run_that_writes_on_behind_the_new_one_repeats_nothing() -> None:
    entries = [_delta("Hel", 0), _delta("Hello wo", 0), _delta("lo", 3), _delta(" world", 5), _delta("rld", 8)]
    assert _read(*entries) == "Hello world"


def test_offsets_count_bytes_so_a_character_split_across_runs_comes_out_whole() -> None:
    text = "né".encode()  # n, then é as two bytes
    first = {b"t": text[:2], b"o": b"0"}
    second = {b"t": text, b"o": b"0"}
    assert _read(first, second, {b"end": b"1"}) == "né"


def test_deltas_without_an_offset_continue_the_text() -> None:
    assert _read({b"t": b"a"}, {b"t": b"b"}, _delta("c", 2)) == "abc"


def test_a_gap_keeps_the_later_bytes() -> None:
    assert _read(_delta("ab", 0), _delta("ef", 4)) == "abef"


def test_the_reader_stops_at_the_end_marker() -> None:
    reader = TokenStreamReader()
    assert reader.feed(_reply(_delta("a", 0), {b"end": b"1", b"status": b"ok"}, _delta("b", 1))) == ["a"]
    assert reader.is_done
