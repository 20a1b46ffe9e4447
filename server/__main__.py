"""``python -m server`` is ``coop-server``."""

from __future__ import annotations

from server.cli import main

main()
