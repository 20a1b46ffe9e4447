"""`coop-server experiment list|show|halt|export` against a real `coop-server serve`, on SQLite and on Postgres:
reads without a token where reads are public, actions only with an operator's, and an export that never
overwrites a file."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import processes
from tests.support.database import empty_database, make_token
from tests.support.scenarios import LOCAL_PLAN


@pytest.fixture
def served(database_url: str, tmp_path: Path) -> Iterator[str]:
    empty_database(database_url)
    with processes.served(database_url, tmp_path) as base:
        yield base


def _token_file(folder: Path, name: str, secret: str) -> Path:
    path = folder / f"{name}.token"
    path.write_text(secret + "\n")
    return path


def experiment_command(url: str, token_file: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in {"COOP_TOKEN", "COOP_COORDINATOR"}}
    tokens = [] if token_file is None else ["--token-file", str(token_file)]
    return subprocess.run(
        [sys.executable, "-m", "server", "experiment", "--coordinator", url, *tokens, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_operator_lists_shows_halts_and_exports_and_a_reader_or_no_token_cannot_halt(
    served: str, database_url: str, tmp_path: Path
) -> None:
    operator = _token_file(tmp_path, "operator", make_token(database_url, "operator", "operator"))
    reader = _token_file(tmp_path, "reader", make_token(database_url, "reader", "analyst"))
    wrong = _token_file(tmp_path, "wrong", "coop_not-a-token-this-coordinator-made")
    created = experiment_command(served, operator, "create", "--plan", str(LOCAL_PLAN), "--no-autopilot")
    assert created.returncode == 0, created.stderr
    experiment = json.loads(created.stdout)["id"]

    listed = experiment_command(served, None, "list")  # reads are public here
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:3] for line in listed.stdout.splitlines()] == [[experiment, "committed", "local"]]
    shown = experiment_command(served, reader, "show", experiment)
    assert shown.returncode == 0, shown.stderr
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    arms = httpx.get(f"{served}/api/experiments/{experiment}/arms").json()
    assert lines[0]["id"] == experiment and [line["name"] for line in lines[1:]] == [arm["name"] for arm in arms]

    for token, refusal in (
        (None, "needs an operator token: pass --token-file or set COOP_TOKEN"),
        (wrong, "HTTP 401: the bearer token is unknown or revoked"),
        (reader, "HTTP 403: this request needs an operator token; 'analyst' is a reader token"),
    ):
        refused = experiment_command(served, token, "halt", experiment)
        assert refused.returncode == 2 and refusal in refused.stderr, refused.stderr
        assert httpx.get(f"{served}/api/experiments/{experiment}").json()["state"] == "committed"
    halted = experiment_command(served, operator, "halt", experiment)
    assert halted.returncode == 0, halted.stderr
    assert json.loads(halted.stdout)["state"] == "halted"
    assert httpx.get(f"{served}/api/experiments/{experiment}").json()["state"] == "halted"

    out = tmp_path / "evidence.tar"
    exported = experiment_command(served, reader, "export", experiment, "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    listing = httpx.get(f"{served}/api/experiments/{experiment}/evidence").json()
    with tarfile.open(out) as tar:
        names = tar.getnames()
        ledger = json.load(tar.extractfile("ledger.json") or io.BytesIO())
    # The bundle: the listed files, the ledger and every training attempt (server.store.evidencefiles).
    assert sorted(names) == sorted([entry["path"] for entry in listing] + ["attempts.json", "ledger.json"])
    recorded = httpx.get(f"{served}/api/experiments/{experiment}/ledger").json()
    assert ledger == recorded
    assert json.loads(exported.stdout)["bytes"] == out.stat().st_size

    again = experiment_command(served, reader, "export", experiment, "--out", str(out))
    assert again.returncode == 0, again.stderr  # the same bytes again: nothing to refuse
    other = tmp_path / "other.tar"
    other.write_bytes(b"an analyst's own file")
    clash = experiment_command(served, reader, "export", experiment, "--out", str(other))
    assert clash.returncode == 2 and "never overwritten" in clash.stderr
    assert other.read_bytes() == b"an analyst's own file"
    missing = experiment_command(served, reader, "export", experiment, "--out", str(tmp_path / "no" / "e.tar"))
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".evidence")]  # no partial file left
