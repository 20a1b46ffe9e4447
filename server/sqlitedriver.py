"""SQLite's connection for the coordinator's async engine: write transactions run on the event loop, one at a time.

SQLite lets one connection write to a file at a time. Here a write transaction (``BEGIN IMMEDIATE``) first takes the
file's write turn, an asyncio lock of the event loop, and then runs each of its statements, its ``COMMIT`` or its
``ROLLBACK`` on the event loop itself:

- such a statement never waits for a lock: the transaction holds the file's write lock, and in WAL mode a read is
  never blocked;
- it is short: every other writer waits while it runs, so the coordinator keeps its write transactions small;
- a trip to another thread (that thread woken, then the event loop) costs more CPU than most such statements.

The one longer step is SQLite's automatic checkpoint: the COMMIT that takes the WAL past 1,000 pages copies it into
the database file before it returns, on the event loop like the rest of the transaction.

A writer of this event loop that waits for its turn waits in asyncio, not in SQLite's busy handler, and gives up
after the busy timeout with SQLite's own error. Statements of a read transaction (a deferred ``BEGIN``) go to a
thread, where a long read does not hold the event loop up. A statement outside any transaction (the guard's token
lookup) runs on the event loop while no writer holds the turn, and in a thread while one does: were it to write, it
would wait for the write lock, which that writer could release only once the event loop runs again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sqlite3
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
Row = tuple[Any, ...]
Description = tuple[tuple[Any, ...], ...] | None
Executed = tuple[Description, list[Row], int, int | None]

# The write turns of each event loop, one per database file.
_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()
_THREADS = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="coop-sqlite")


def _turn(path: str) -> asyncio.Lock:
    return _TURNS.setdefault(asyncio.get_running_loop(), {}).setdefault(path, asyncio.Lock())


def _takes_write_lock(sql: str) -> bool:
    return sql.lstrip()[:15].upper() in {"BEGIN IMMEDIATE", "BEGIN EXCLUSIVE"}


def _execute(
    connection: sqlite3.Connection, sql: str, parameters: Sequence[Any] | None, many: Iterable[Sequence[Any]] | None
) -> Executed:
    """The statement run, with its description, every row, the row count and the last row id."""
    cursor = connection.cursor()
    try:
        if many is not None:
            cursor.executemany(sql, many)
        else:
            cursor.execute(sql, parameters if parameters is not None else ())
        description = cursor.description
        rows = cursor.fetchall() if description else []
        return description, rows, cursor.rowcount, cursor.lastrowid
    finally:
        cursor.close()


class Cursor:
    """What SQLAlchemy's adapter asks of a cursor, with the work done in ``execute`` and the results kept here."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.description: Description = None
        self.rowcount = -1
        self.lastrowid: int | None = None
        self.arraysize = 1
        self._rows: list[Row] = []

    async def __aenter__(self) -> Cursor:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    async def _run(self, sql: str, parameters: Sequence[Any] | None, many: Iterable[Sequence[Any]] | None) -> Cursor:
        self.description, self._rows, self.rowcount, self.lastrowid = await self._connection.run(sql, parameters, many)
        return self

    async def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> Cursor:
        return await self._run(sql, parameters, None)

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any]]) -> Cursor:
        return await self._run(sql, None, list(parameters))

    async def fetchall(self) -> list[Row]:
        rows, self._rows = self._rows, []
        return rows

    async def fetchone(self) -> Row | None:
        return self._rows.pop(0) if self._rows else None

    async def fetchmany(self, size: int | None = None) -> list[Row]:
        count = self.arraysize if size is None else size
        rows, self._rows = self._rows[:count], self._rows[count:]
        return rows

    async def close(self) -> None:
        self._rows = []


class Connection:
    """What SQLAlchemy's aiosqlite adapter asks of aiosqlite's connection, over a sqlite3 connection in autocommit
    mode (the coordinator sends its own ``BEGIN``)."""

    def __init__(self, connection: sqlite3.Connection, path: str, timeout: float) -> None:
        self._connection: sqlite3.Connection | None = connection
        self._path = path
        self._timeout = timeout
        self._turn: asyncio.Lock | None = None  # held from BEGIN IMMEDIATE to the transaction's end
        self._in_thread: concurrent.futures.Future[Any] | None = None

    @property
    def isolation_level(self) -> str | None:
        return self._open().isolation_level

    def cursor(self) -> Cursor:
        return Cursor(self)

    def _open(self) -> sqlite3.Connection:
        if self._connection is None:
            raise ValueError("Connection closed")
        return self._connection

    async def _settled(self) -> sqlite3.Connection:
        """The connection, once the work it sent to a thread is done (a caller cancelled while it waited for that
        work leaves it running there)."""
        if self._in_thread is not None and not self._in_thread.done():
            await asyncio.wait([asyncio.wrap_future(self._in_thread)])
        return self._open()

    async def _thread(self, function: Callable[..., T], *arguments: Any) -> T:
        self._in_thread = _THREADS.submit(function, *arguments)
        return await asyncio.wrap_future(self._in_thread)

    async def _take_turn(self) -> None:
        turn = _turn(self._path)
        try:
            async with asyncio.timeout(self._timeout):
                await turn.acquire()
        except TimeoutError:
            raise sqlite3.OperationalError("database is locked") from None
        self._turn = turn

    def _end_turn_if_done(self, connection: sqlite3.Connection) -> None:
        """Give the turn back once the write transaction ended (a COMMIT, a ROLLBACK, or a failed BEGIN)."""
        if not connection.in_transaction:
            self._give_turn_back()

    def _give_turn_back(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.release()

    async def run(self, sql: str, parameters: Sequence[Any] | None, many: Iterable[Sequence[Any]] | None) -> Executed:
        connection = await self._settled()
        if self._turn is None and _takes_write_lock(sql):
            await self._take_turn()
        if self._turn is not None:
            try:
                return _execute(connection, sql, parameters, many)
            finally:
                self._end_turn_if_done(connection)
        if connection.in_transaction or _turn(self._path).locked():
            return await self._thread(_execute, connection, sql, parameters, many)
        return _execute(connection, sql, parameters, many)

    async def _end(self, end: Callable[[sqlite3.Connection], None]) -> None:
        """``end`` (commit or rollback) the open transaction, if one is open, and give the turn back."""
        connection = await self._settled()
        try:
            if connection.in_transaction:
                end(connection)
        finally:
            self._end_turn_if_done(connection)

    async def commit(self) -> None:
        await self._end(sqlite3.Connection.commit)

    async def rollback(self) -> None:
        await self._end(sqlite3.Connection.rollback)

    async def create_function(self, *arguments: Any, **named: Any) -> None:
        (await self._settled()).create_function(*arguments, **named)

    async def close(self) -> None:
        if self._connection is None:
            return
        connection = await self._settled()
        self._connection = None
        try:
            connection.close()  # an open transaction is rolled back
        finally:
            self._give_turn_back()

    def stop(self) -> None:
        """Close at once (SQLAlchemy's terminate)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
        self._give_turn_back()


async def connect(path: str, timeout: float) -> Connection:
    """A connection to the SQLite file at ``path``, in autocommit mode; a writer waits ``timeout`` seconds for the
    write lock, or for its turn."""
    # Autocommit: pysqlite's own deferred BEGIN would let a transaction read first and then fail to upgrade to the
    # write lock (SQLITE_BUSY, which the busy timeout does not cover); server.db begins transactions itself.
    connection = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    return Connection(connection, os.path.realpath(path), timeout)
