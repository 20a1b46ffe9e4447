"""Files that hold a secret (an agent's token, the coordinator's TLS key and home secret): each must belong to the
user that reads it and be readable by nobody else, so that a unit running as ``coop`` reads what only ``coop`` can.

A file that breaks either rule is refused before it is read, by a message that names the file, its owner and mode,
the user that tried, and the commands that fix it."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from experiment.core.errors import CoopError


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def problem(path: Path, what: str, status: os.stat_result, uid: int) -> str | None:
    """Why ``path`` may not hold a secret read by ``uid``, or None when it may."""
    owner, reader = user_name(status.st_uid), user_name(uid)
    described = f"the {what} {path} (owner {owner}, mode {stat.S_IMODE(status.st_mode):04o})"
    fix = f"chown {reader}: {path} && chmod 600 {path}"
    if not stat.S_ISREG(status.st_mode):
        return f"{described} is not a regular file"
    if status.st_uid != uid:
        return f"{described} must belong to {reader}, which reads it, and to nobody else; as root: {fix}"
    if status.st_mode & 0o077:
        return f"{described} is open to users other than {reader}; make it private: chmod 600 {path}"
    if not status.st_mode & stat.S_IRUSR:
        return f"{described} is not readable by its owner {reader}: chmod 600 {path}"
    return None


def check(path: Path, what: str) -> None:
    """A CoopError unless ``path`` is a regular file of this process's user, readable by it alone."""
    try:
        status = path.stat()
    except FileNotFoundError:
        raise CoopError(f"the {what} {path} does not exist") from None
    except OSError as exc:
        raise CoopError(f"cannot read the {what} {path}: {exc.strerror}") from None
    found = problem(path, what, status, os.geteuid())
    if found is not None:
        raise CoopError(found)


def read(path: Path, what: str) -> bytes:
    """The bytes of a secret file that passes ``check``."""
    check(path, what)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CoopError(f"cannot read the {what} {path}: {exc.strerror}") from None
