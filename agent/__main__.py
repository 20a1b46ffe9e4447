"""``python -m agent`` is ``coop-agent``."""

from __future__ import annotations

from agent.cli import main

main()
