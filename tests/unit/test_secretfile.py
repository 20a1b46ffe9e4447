"""A secret file (an agent's token, the coordinator's key and home secret) is read only when it belongs to the user
that reads it and nobody else can read it; each refusal names the file, its owner and mode, and the fix."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from experiment.core import secretfile
from experiment.core.errors import CoopError

ME = os.geteuid()
MY_NAME = pwd.getpwuid(ME).pw_name


def _secret(path: Path, mode: int) -> Path:
    path.touch(mode=0o600)
    path.write_text("coop_secret\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_file_of_this_user_that_only_it_can_read_is_read(tmp_path: Path, mode: int) -> None:
    assert secretfile.read(_secret(tmp_path / "token", mode), "token file") == b"coop_secret\n"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o610])
def test_a_file_others_may_open_is_refused_naming_owner_mode_and_fix(tmp_path: Path, mode: int) -> None:
    token = _secret(tmp_path / "token", mode)
    with pytest.raises(CoopError) as refused:
        secretfile.read(token, "token file")
    assert str(refused.value) == (
        f"the token file {token} (owner {MY_NAME}, mode {mode:04o}) is open to users other than {MY_NAME}; "
        f"make it private: chmod 600 {token}"
    )
    assert token.stat().st_mode & 0o777 == mode  # nothing was changed


def test_a_file_of_another_user_is_refused_with_the_chown_that_fixes_it(tmp_path: Path) -> None:
    """The runbook's first failure: a token installed by root, mode 0600 (or root:coop 0640), read by coop."""
    token = _secret(tmp_path / "token", 0o600)
    reader = next(entry for entry in pwd.getpwall() if entry.pw_uid != ME)
    found = secretfile.problem(token, "token file", token.stat(), reader.pw_uid)
    assert found == (
        f"the token file {token} (owner {MY_NAME}, mode 0600) must belong to {reader.pw_name}, which reads it, and "
        f"to nobody else; as root: chown {reader.pw_name}: {token} && chmod 600 {token}"
    )


def test_a_file_its_owner_cannot_read_is_refused(tmp_path: Path) -> None:
    token = _secret(tmp_path / "token", 0o200)
    assert secretfile.problem(token, "token file", token.stat(), ME) == (
        f"the token file {token} (owner {MY_NAME}, mode 0200) is not readable by its owner {MY_NAME}: chmod 600 {token}"
    )


def test_a_missing_file_or_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CoopError, match="does not exist"):
        secretfile.read(tmp_path / "absent", "token file")
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    with pytest.raises(CoopError, match="is not a regular file"):
        secretfile.read(folder, "token file")
