"""The action forms' fields (HTML form posts; the CSRF token travels beside them and is checked before)."""

from __future__ import annotations

import msgspec


class Confirmation(msgspec.Struct, frozen=True):
    """An irreversible action shows a confirmation page first; its form sends ``confirm=yes``."""

    confirm: str = ""


class Switch(msgspec.Struct, frozen=True):
    on: str = ""

    @property
    def value(self) -> bool:
        return self.on == "yes"
