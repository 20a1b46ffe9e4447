"""The claims of one coordinator process: they wait for work without polling.

A transaction that makes a job claimable wakes the waiting claims once it commits.

A job becomes claimable when it is queued (new, retried or requeued) or when a gang's rank 0 opens its other
ranks. The code that does so calls ``claimable(session)``. When that session commits, every claim waiting in this
process wakes and tries once more. On Postgres the commit also sends ``NOTIFY coop_claimable``, and each
coordinator process LISTENs on its own connection, so claims waiting in another ``serve`` process on the same
database wake too. A claim that is never woken still looks again every ``claim_recheck_seconds`` (a safety net
for a lost listening connection).

On SQLite a claim's transaction waits its turn to write as any writer does (server.sqlitedriver); Postgres claims
run side by side (``FOR UPDATE SKIP LOCKED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

log = logging.getLogger("coop.server.claims")

CHANNEL = "coop_claimable"
RECONNECT_SECONDS = 5.0  # between attempts to open the listening connection
# session.info keys: the process's Claims (set by the session maker) and whether this transaction made work.
CLAIMS = "coop.claims"
_CLAIMABLE = "coop.claimable"


class Claims:
    """The claims of one coordinator process, woken when work is made."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def ticket(self) -> asyncio.Event:
        """Take this before looking for work; ``wait`` on it then wakes for any work made since."""
        return self._event

    def wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    @staticmethod
    async def wait(ticket: asyncio.Event, seconds: float) -> None:
        """Until work is made or ``seconds`` pass, whichever is first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ticket.wait(), timeout=max(0.0, seconds))


def of(session: Any) -> Claims:
    """The Claims of the process whose session maker made ``session``."""
    claims = session.info.get(CLAIMS)
    if not isinstance(claims, Claims):
        raise TypeError("the session was not made by the coordinator's session maker (server.app)")
    return claims


def claimable(session: Any) -> None:
    """Mark the session's transaction: once it commits, a job is claimable that was not before."""
    session.info[_CLAIMABLE] = True


def _notify_in_transaction(session: Session) -> None:
    if session.info.get(_CLAIMABLE) and session.get_bind().dialect.name == "postgresql":
        session.connection().exec_driver_sql(f"NOTIFY {CHANNEL}")  # delivered when the transaction commits


def _wake_after_commit(session: Session) -> None:
    if session.info.pop(_CLAIMABLE, False):
        claims = session.info.get(CLAIMS)
        if isinstance(claims, Claims):
            claims.wake()


def _forget_after_rollback(session: Session) -> None:
    session.info.pop(_CLAIMABLE, None)


event.listen(Session, "before_commit", _notify_in_transaction)
event.listen(Session, "after_commit", _wake_after_commit)
event.listen(Session, "after_soft_rollback", lambda session, _transaction: _forget_after_rollback(session))


CLOSE_SECONDS = 5.0  # a listening connection's close waits this long for the server, then drops the socket


async def listen(database_url: str, claims: Claims) -> None:
    """Wake this process's claims on every NOTIFY from any coordinator process (Postgres only); reconnects after a
    lost connection, waking the claims once so that they look for what they may have missed."""
    dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    while True:
        try:
            await _listen_once(dsn, claims)
            log.warning("the connection listening for claimable jobs closed; reconnecting")
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("cannot listen for claimable jobs (%s); retrying", exc)
            await asyncio.sleep(RECONNECT_SECONDS)


async def _listen_once(dsn: str, claims: Claims) -> None:
    """Listen on one connection until it is lost."""
    connection = await asyncpg.connect(dsn)
    lost = asyncio.Event()
    try:
        connection.add_termination_listener(lambda _connection: lost.set())
        await connection.add_listener(CHANNEL, lambda *_notification: claims.wake())
        claims.wake()  # what was queued while no connection listened
        await lost.wait()
    finally:
        await connection.close(timeout=CLOSE_SECONDS)
