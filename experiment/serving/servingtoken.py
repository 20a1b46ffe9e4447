"""The serving token that the probe and the benchmark share: from a file, else from the environment."""

from __future__ import annotations

import os
from pathlib import Path

from experiment.core.errors import CoopError

TOKEN_ENV = "COOP_SERVING_TOKEN"


def read_token(token_file: Path | None) -> str:
    """The serving token: the file's content, else ``COOP_SERVING_TOKEN``."""
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CoopError(f"cannot read the serving token file {token_file}: {exc}") from exc
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if len(token) < 16:
        raise CoopError(f"the serving token (--token-file or {TOKEN_ENV}) must be at least 16 characters")
    return token
