from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest

from experiment.core.canonical import canonical_bytes, identity, read_json, write_new_bytes, write_new_json
from experiment.core.errors import CoopError


def test_canonical_json_sorts_keys_compacts_and_escapes_non_ascii() -> None:
    assert canonical_bytes({"b": 1, "a": [1, "é"]}) == b'{"a":[1,"\\u00e9"],"b":1}'


def test_identity_is_sha256_of_canonical_json_and_ignores_key_order() -> None:
    assert identity({"x": 1, "y": 2}) == identity({"y": 2, "x": 1})
    assert identity({"x": 1}) == hashlib.sha256(b'{"x":1}').hexdigest()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused(value: float) -> None:
    with pytest.raises(CoopError, match="canonical JSON"):
        identity({"x": value})


def test_write_new_refuses_to_overwrite_different_content(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "record.json"
    write_new_json(path, {"a": 1})
    with pytest.raises(CoopError, match="refusing to overwrite"):
        write_new_json(path, {"a": 2})
    assert read_json(path) == {"a": 1}


def test_write_new_accepts_an_identical_replay(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    write_new_bytes(path, b"same")
    write_new_bytes(path, b"same")
    assert path.read_bytes() == b"same"
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]  # no temporary files left behind


def test_read_json_names_the_file_it_cannot_parse(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(CoopError, match=r"broken\.json"):
        read_json(path)
