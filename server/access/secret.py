"""The coordinator home's secret: made once per home (COOP_HOME/web-secret, mode 0600), and the keys derived from
it (the web UI's session and CSRF keys, the probes' serving tokens), so that they outlive a restart."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import uuid
from pathlib import Path

from experiment.core import secretfile
from experiment.core.errors import CoopError

FILE = "web-secret"  # its name from when only the web UI used it; kept so that existing homes keep their keys
SECRET_BYTES = 32


def _read_or_create(path: Path) -> bytes:
    """The home's secret; a new one is written beside it and linked into place, so that two coordinators
    starting at once agree on one secret and neither reads a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        draft = path.with_name(f".{FILE}.{secrets.token_hex(8)}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_hex(SECRET_BYTES) + "\n")
                file.flush()
                os.fsync(file.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(draft, path)
        finally:
            draft.unlink()
    try:
        return bytes.fromhex(secretfile.read(path, "home's secret").decode().strip())
    except ValueError as exc:  # UnicodeDecodeError is one
        raise CoopError(f"{path} is not a hex secret; delete it and restart to make a new one") from exc


def derive(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, purpose.encode(), hashlib.sha256).digest()


def load(home: Path) -> bytes:
    """The coordinator home's secret."""
    secret = _read_or_create(home / FILE)
    if len(secret) < SECRET_BYTES:
        raise CoopError(f"{home / FILE} holds fewer than {SECRET_BYTES} bytes; delete it and restart to make a new one")
    return secret


def serving_token(home: Path, experiment_id: uuid.UUID) -> str:
    """The bearer token of an experiment's probes: handed to the agents of its serving jobs, stored nowhere."""
    return derive(load(home), f"coop serving token {experiment_id}").hex()
