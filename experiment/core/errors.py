"""The one domain exception of the science: a message a person can act on."""

from __future__ import annotations


class CoopError(Exception):
    """A refusal with a message that names what is wrong (the CLI prints it and exits 2)."""


# The exit status of a command whose gang lost a peer or its link (sysexits' EX_TEMPFAIL: try again later).
EXIT_LINK = 75


class LinkError(CoopError):
    """A rank's collective or rendezvous broke because a peer or the link between them did: nothing is wrong with
    the run itself, and a retry of the gang resumes it (the CLI exits EXIT_LINK; the agent reports the attempt lost,
    which the coordinator retries)."""
