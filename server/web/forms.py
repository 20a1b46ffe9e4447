"""The action forms' fields (HTML form posts; the CSRF token travels beside them and is checked before)."""

from __future__ import annotations

from typing import TypeAlias

import msgspec
from litestar.params import URLEncodedBody


class Confirmation(msgspec.Struct, frozen=True):
    """An irreversible action shows a confirmation page first; its form sends ``confirm=yes``."""

    confirm: str = ""


Confirmed: TypeAlias = URLEncodedBody[Confirmation]


class Switch(msgspec.Struct, frozen=True):
    on: str = ""

    @property
    def value(self) -> bool:
        return self.on == "yes"
