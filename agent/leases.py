"""What the agent holds of the coordinator's queue: the attempts it was given, and the claim in flight."""

from __future__ import annotations

import secrets
import threading
import uuid
from collections.abc import Iterable

from experiment import wire


class Leases:
    """The attempts this agent holds, from the reply of their claim until the coordinator has settled their result
    (a spooled result may wait for it), and the key of the claim in flight, whose reply has not been read. Every
    heartbeat names both: the coordinator ends as lost an active attempt of this agent it names neither by id nor by
    claim key."""

    def __init__(self, held: Iterable[uuid.UUID] = ()) -> None:
        self._held: set[uuid.UUID] = set(held)
        self._claiming: str | None = None
        self._lock = threading.Lock()
        # Held by a heartbeat from reading what it names until its reply: a claim takes it before it is sent, so
        # that no heartbeat read before the claim reaches the coordinator after it.
        self.beating = threading.Lock()

    def new_claim(self) -> str:
        """A key for the next claim, named by every heartbeat from now until its reply is read."""
        key = secrets.token_urlsafe(24)
        with self.beating, self._lock:
            self._claiming = key
        return key

    def claimed(self, attempt_id: uuid.UUID | None) -> None:
        """The claim's reply was read: the attempt it gave (if any) is held, and no claim is in flight."""
        with self._lock:
            if attempt_id is not None:
                self._held.add(attempt_id)
            self._claiming = None

    def release(self, attempt_id: uuid.UUID) -> None:
        with self._lock:
            self._held.discard(attempt_id)

    def heartbeat(self) -> wire.HeartbeatRequest:
        """What a heartbeat names now (the caller holds ``beating`` until its reply)."""
        with self._lock:
            return wire.HeartbeatRequest(attempt_ids=sorted(self._held), claiming=self._claiming)
