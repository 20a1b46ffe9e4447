"""SQLite's connection for the coordinator's async engine: aiosqlite's, with each statement one trip to its thread.

aiosqlite runs a sqlite3 connection in a thread of its own and sends every call there: SQLAlchemy's statement is a
cursor made, executed, its rows fetched and the cursor closed, four trips (each a thread wake-up and a wake-up of
the event loop). Here a cursor is made, executed, read and closed in one trip, and a commit or rollback with no
transaction open (after a single read, or as the pool takes back a connection whose transaction ended) makes none.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterable, Sequence
from functools import partial
from types import TracebackType
from typing import Any

import aiosqlite

ITERATION_CHUNK = 64  # aiosqlite's own default; the engine never iterates a cursor through aiosqlite

Row = tuple[Any, ...]
Description = tuple[tuple[Any, ...], ...] | None


def _execute(
    connection: sqlite3.Connection, sql: str, parameters: Sequence[Any] | None, many: Iterable[Sequence[Any]] | None
) -> tuple[Description, list[Row], int, int | None]:
    """In the connection's thread: the statement run, with its description, every row, the row count and the last
    row id."""
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
        self.description, self._rows, self.rowcount, self.lastrowid = await self._connection.in_thread(
            _execute, sql, parameters, many
        )
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


class Connection(aiosqlite.Connection):
    def cursor(self) -> Cursor:  # type: ignore[override]
        return Cursor(self)

    async def in_thread(self, function: Any, *arguments: Any) -> Any:
        """``function(sqlite3_connection, *arguments)`` in the connection's thread."""
        if not self._running or self._connection is None:
            raise ValueError("Connection closed")
        future = asyncio.get_running_loop().create_future()
        self._tx.put_nowait((future, partial(function, self._connection, *arguments)))
        return await future

    async def commit(self) -> None:
        if self._connection is not None and self._connection.in_transaction:
            await super().commit()

    async def rollback(self) -> None:
        if self._connection is not None and self._connection.in_transaction:
            await super().rollback()


async def connect(path: str, timeout: float) -> Connection:
    """A connection to the SQLite file at ``path``: its thread started (a daemon, as SQLAlchemy makes aiosqlite's,
    so that a connection left open never holds up the interpreter's exit) and the file opened."""
    connection = Connection(partial(sqlite3.connect, path, timeout=timeout), ITERATION_CHUNK)
    connection._thread.daemon = True
    await connection
    return connection
