"""A command's stdout line as the agent's event: a NUL it printed (raw or escaped in its JSON) arrives as U+FFFD,
since the coordinator's Postgres text holds none and the coordinator refuses an event with one."""

from __future__ import annotations

import msgspec

from agent.supervisor import to_event


def test_a_raw_nul_in_an_output_line_becomes_a_replacement_character() -> None:
    raw = b"loss 0.5\x00\xff done\n"
    event, decoded = to_event(raw.decode(errors="replace").rstrip("\n"))
    assert decoded is None
    assert event.kind == "output"
    assert event.body == {"line": "loss 0.5\ufffd\ufffd done"}
    assert b"\\u0000" not in msgspec.json.encode(event)


def test_a_nul_escaped_in_a_json_line_becomes_a_replacement_character() -> None:
    event, decoded = to_event('{"event": "step", "note": "a\\u0000b", "tags": ["\\u0000"], "k\\u0000": 1}')
    assert event.kind == "step"
    assert decoded == {"event": "step", "note": "a\ufffdb", "tags": ["\ufffd"], "k\ufffd": 1}
    assert event.body == decoded
    assert b"\\u0000" not in msgspec.json.encode(event)


def test_a_line_without_nul_is_kept_as_printed() -> None:
    event, decoded = to_event('{"event": "prepared", "prepared_identity": "ab", "count": 3}')
    assert decoded == {"event": "prepared", "prepared_identity": "ab", "count": 3}
    assert event.body == decoded
    assert to_event("plain text")[0].body == {"line": "plain text"}
