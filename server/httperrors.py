"""The coordinator's request errors besides lifecycle.Refused; the API maps each to its status code."""

from __future__ import annotations

from experiment.core.errors import CoopError


class NotFound(CoopError):
    """A named row does not exist (404)."""


class Unauthenticated(CoopError):
    """No bearer token, or one that is unknown or revoked (401)."""


class Forbidden(CoopError):
    """A valid token of the wrong role, or an agent acting on another agent's lease (403)."""


class BadRequest(CoopError):
    """A request the server cannot read: a missing header, a malformed key (400)."""


class IdempotencyConflict(CoopError):
    """An Idempotency-Key replayed with a different payload (409)."""


class TooLarge(CoopError):
    """A body over its size limit (413)."""


class InsufficientStorage(CoopError):
    """The blob store's disk is full (507): nothing of the upload was kept, and the same upload succeeds once space
    is freed (an agent keeps it in its spool and retries, as it does a 5xx)."""
