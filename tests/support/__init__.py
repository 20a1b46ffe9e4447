"""What the test suites share: real processes, one bounded wait, the databases and tokens, one fake agent on the
real client, and the scenarios that bring an experiment to a phase."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
