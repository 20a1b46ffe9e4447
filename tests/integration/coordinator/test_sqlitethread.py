"""The coordinator's SQLite connection (server.sqlitethread) under SQLAlchemy's async engine: what it reads and
writes is what Python's own sqlite3 reads from the same file; errors are sqlite3's, and leave the file as it was;
a statement is one trip to the connection's thread, and a commit or rollback with no transaction open is none."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import exc, text

from server import db, sqlitethread
from server.settings import sqlite_url

ROWS = [(i, f"name {i}", i * 0.5, bytes([i % 256]) * 3) for i in range(300)]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    file = tmp_path / "driver.sqlite3"
    with contextlib.closing(sqlite3.connect(file)) as direct:
        direct.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT UNIQUE, weight REAL, raw BLOB)")
    return file


def _direct(path: Path, sql: str) -> list[Any]:
    """What sqlite3, apart from the engine, reads from the file."""
    with contextlib.closing(sqlite3.connect(path)) as direct:
        return direct.execute(sql).fetchall()


@contextlib.contextmanager
def _trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Each trip to a connection's thread, named by what it ran, while the block runs."""
    trips: list[str] = []
    in_thread = sqlitethread.Connection.in_thread
    execute = sqlitethread.aiosqlite.Connection._execute

    async def counted_in_thread(self: sqlitethread.Connection, function: Any, *arguments: Any) -> Any:
        trips.append(str(arguments[0]))
        return await in_thread(self, function, *arguments)

    async def counted_execute(self: sqlitethread.Connection, function: Any, *arguments: Any, **named: Any) -> Any:
        trips.append(getattr(function, "__name__", str(function)))
        return await execute(self, function, *arguments, **named)

    with monkeypatch.context() as patch:
        patch.setattr(sqlitethread.Connection, "in_thread", counted_in_thread)
        patch.setattr(sqlitethread.aiosqlite.Connection, "_execute", counted_execute)
        yield trips


def test_what_the_engine_writes_and_reads_is_what_sqlite3_reads_from_the_file(path: Path) -> None:
    async def go() -> tuple[list[Any], list[Any], int]:
        engine = db.create_engine(sqlite_url(path))
        try:
            async with engine.begin() as connection:
                insert = text("INSERT INTO items (id, name, weight, raw) VALUES (:id, :name, :weight, :raw)")
                await connection.execute(
                    insert, [dict(zip(("id", "name", "weight", "raw"), r, strict=True)) for r in ROWS]
                )
                returned = await connection.execute(
                    text("UPDATE items SET weight = weight + 1 WHERE id < 5 RETURNING id, weight")
                )
                changed = (await connection.execute(text("DELETE FROM items WHERE id >= 290"))).rowcount
            async with engine.connect() as connection:
                read = (await connection.execute(text("SELECT id, name, weight, raw FROM items ORDER BY id"))).all()
            return [tuple(r) for r in returned], [tuple(r) for r in read], changed
        finally:
            await engine.dispose()

    returned, read, deleted = asyncio.run(go())
    assert sorted(returned) == [(i, i * 0.5 + 1) for i in range(5)]
    assert deleted == 10
    assert read == _direct(path, "SELECT id, name, weight, raw FROM items ORDER BY id")
    expected = [(i, n, w + 1 if i < 5 else w, r) for i, n, w, r in ROWS if i < 290]
    assert read == expected


def test_a_refused_statement_raises_sqlites_error_and_its_transaction_leaves_nothing(path: Path) -> None:
    async def go() -> None:
        engine = db.create_engine(sqlite_url(path))
        sessions = db.session_maker(engine)  # the coordinator's sessions, which BEGIN IMMEDIATE their writes
        try:
            async with sessions() as session, session.begin():
                await session.execute(text("INSERT INTO items (id, name) VALUES (1, 'kept')"))
            with pytest.raises(exc.IntegrityError) as refused:
                async with sessions() as session, session.begin():
                    await session.execute(text("INSERT INTO items (id, name) VALUES (2, 'undone')"))
                    await session.execute(text("INSERT INTO items (id, name) VALUES (3, 'kept')"))
            assert isinstance(refused.value.orig, sqlite3.IntegrityError)
            async with sessions() as session, session.begin():  # the connection is good for the next one
                await session.execute(text("INSERT INTO items (id, name) VALUES (4, 'after')"))
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert _direct(path, "SELECT id, name FROM items ORDER BY id") == [(1, "kept"), (4, "after")]


def test_a_statement_is_one_trip_and_a_commit_with_nothing_open_is_none(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> dict[str, list[str]]:
        engine = db.create_engine(sqlite_url(path))
        seen: dict[str, list[str]] = {}
        try:
            async with engine.connect() as connection:
                await connection.execute(text("SELECT 1"))  # the pool's first connection, made outside the count
                await connection.commit()
                with _trips(monkeypatch) as trips:
                    rows = (await connection.execute(text("SELECT id FROM items"))).all()
                    assert rows == []
                    seen["read"] = list(trips)
                    trips.clear()
                    await connection.commit()  # nothing open: sqlite3 is in autocommit after a lone read
                    seen["empty commit"] = list(trips)
                    trips.clear()
                    await connection.exec_driver_sql("BEGIN IMMEDIATE")
                    await connection.execute(text("INSERT INTO items (id, name) VALUES (7, 'seven')"))
                    await connection.commit()
                    seen["write"] = list(trips)
        finally:
            await engine.dispose()
        return seen

    seen = asyncio.run(go())
    assert seen["read"] == ["SELECT id FROM items"]
    assert seen["empty commit"] == []
    assert seen["write"] == ["BEGIN IMMEDIATE", "INSERT INTO items (id, name) VALUES (7, 'seven')", "commit"]
    assert _direct(path, "SELECT id, name FROM items") == [(7, "seven")]
