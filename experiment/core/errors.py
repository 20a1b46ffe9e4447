"""The one domain exception of the science: a message a person can act on."""

from __future__ import annotations


class CoopError(Exception):
    """A refusal with a message that names what is wrong (the CLI prints it and exits 2)."""
