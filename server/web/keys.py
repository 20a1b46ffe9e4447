"""The web UI's keys, derived from the coordinator home's secret (server.access.secret): the session cookie's key
and the CSRF tokens' HMAC key, so that sessions outlive a restart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.access import secret


@dataclass(frozen=True)
class Keys:
    session: bytes  # 32 bytes: AES-256-GCM for Litestar's cookie session backend
    csrf: str  # the HMAC secret of Litestar's CSRF tokens


def load(home: Path) -> Keys:
    home_secret = secret.load(home)
    return Keys(
        session=secret.derive(home_secret, "coop web session"), csrf=secret.derive(home_secret, "coop web csrf").hex()
    )
