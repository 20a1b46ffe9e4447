"""The spool's uploader: whenever the coordinator answers, it sends what the spool holds, in spool order, and
releases an attempt once the coordinator has its result."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.client import Coordinator, Rejected, Unreachable, Untrusted
from agent.leases import Leases
from agent.spool import BLOB_PREFIX, Spool, Upload

log = logging.getLogger("coop.agent")


class Uploader:
    def __init__(
        self, client: Coordinator, spool: Spool, leases: Leases, distrust: Callable[[Untrusted], None]
    ) -> None:
        self.client, self.spool, self.leases, self.distrust = client, spool, leases, distrust

    def loop(self) -> None:
        while True:
            self.spool.changed.wait(1.0)
            self.spool.changed.clear()
            try:
                sent = self.send_pending()
            except Untrusted as exc:
                self.distrust(exc)
                return
            if not sent:
                time.sleep(1.0)

    def send_pending(self) -> bool:
        """Send every pending upload in spool order; False when the coordinator is unreachable."""
        while pending := self.spool.pending():
            for upload in pending:
                send, last_word = self._senders[upload.kind]
                try:
                    send(upload)
                except Unreachable as exc:
                    log.warning("upload %s deferred: %s", upload.key, exc)
                    return False
                except Rejected as exc:
                    # A refusal (the attempt ended, the lease is gone) does not change on replay: keep the row
                    # as rejected, for the record, and go on with the rest.
                    log.error("upload %s rejected: %s", upload.key, exc)
                    self.spool.settle(upload, "rejected", str(exc))
                else:
                    self.spool.settle(upload, "acknowledged")
                if last_word:  # the coordinator has the attempt's result, or refused it
                    self.leases.release(upload.attempt_id)
        return True

    @property
    def _senders(self) -> dict[str, tuple[Callable[[Upload], object], bool]]:
        """Per spooled upload kind, how it is sent, and whether it is its attempt's last word (the result)."""
        client = self.client
        return {
            "events": (lambda upload: client.upload_events(upload.attempt_id, upload.key, upload.body), False),
            # Idempotent by content: a blob stored before is not stored again.
            "blob": (
                lambda upload: client.upload_blob(upload.attempt_id, upload.key.rsplit(BLOB_PREFIX, 1)[1], upload.body),
                False,
            ),
            "result": (lambda upload: client.upload_result(upload.attempt_id, upload.key, upload.body), True),
        }

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.spool.pending(limit=1):
                return True
            self.spool.changed.set()
            time.sleep(0.1)
        return not self.spool.pending(limit=1)
