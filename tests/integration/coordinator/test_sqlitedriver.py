"""The coordinator's SQLite connection (server.sqlitedriver) under SQLAlchemy's async engine: what it reads and
writes is what Python's own sqlite3 reads from the same file; errors are sqlite3's, and leave the file as it was; a
write transaction runs on the event loop and a read transaction in a thread, as SQLite itself reports; writers of
one event loop take turns without holding the loop up, and a writer that gives up or is cancelled leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, exc, text
from sqlalchemy.ext.asyncio import AsyncEngine

from server import db, sqlitedriver
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


def _thread_name() -> str:
    return threading.current_thread().name


def _where(engine: AsyncEngine) -> None:
    """``thread_name()`` in SQL: the name of the thread SQLite runs the statement in."""

    def register(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.create_function("thread_name", 0, _thread_name)

    event.listen(engine.sync_engine, "connect", register)


def test_a_write_transaction_runs_on_the_event_loop_and_a_read_transaction_in_a_thread(path: Path) -> None:
    async def go() -> dict[str, str]:
        engine = db.create_engine(sqlite_url(path))
        _where(engine)
        sessions = db.session_maker(engine)
        seen = {}
        try:
            async with sessions() as session, session.begin():
                await session.execute(text("INSERT INTO items (id, name) VALUES (1, 'one')"))
                seen["writer"] = (await session.execute(text("SELECT thread_name()"))).scalar_one()
            async with sessions() as session:
                db.reading(session)
                async with session.begin():
                    seen["reader"] = (await session.execute(text("SELECT thread_name()"))).scalar_one()
            async with engine.connect() as connection:  # a lone statement, with no writer about
                seen["lone"] = (await connection.execute(text("SELECT thread_name()"))).scalar_one()
            seen["loop"] = threading.current_thread().name
        finally:
            await engine.dispose()
        return seen

    seen = asyncio.run(go())
    assert seen["writer"] == seen["loop"] == seen["lone"]
    assert seen["reader"] != seen["loop"]
    assert seen["reader"].startswith("coop-sqlite")


def test_writers_of_one_event_loop_take_turns_and_the_loop_runs_while_one_waits(path: Path) -> None:
    """Writer A holds its transaction open across a sleep. Writer B and a lone INSERT wait for it without holding
    the event loop up (a ticker goes on ticking), and land after A's commit."""

    async def go() -> int:
        engine = db.create_engine(sqlite_url(path))
        sessions = db.session_maker(engine)
        a_began = asyncio.Event()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async def writer_a() -> None:
            async with sessions() as session, session.begin():
                await session.execute(text("INSERT INTO items (id, name) VALUES (1, 'a')"))
                a_began.set()
                await asyncio.sleep(0.5)
                await session.execute(text("INSERT INTO items (id, name) VALUES (2, 'a again')"))

        async def writer_b() -> None:
            await a_began.wait()
            async with sessions() as session, session.begin():
                # what B sees when its turn comes: A's rows, committed
                count = (await session.execute(text("SELECT count(*) FROM items"))).scalar_one()
                await session.execute(text("INSERT INTO items (id, name) VALUES (:id, 'b')"), {"id": 10 + count})

        async def lone() -> None:
            await a_began.wait()
            async with engine.connect() as connection:
                await connection.execute(text("INSERT INTO items (id, name) VALUES (20, 'lone')"))

        ticking = asyncio.create_task(ticker())
        try:
            await asyncio.gather(writer_a(), writer_b(), lone())
        finally:
            ticking.cancel()
            await engine.dispose()
        return ticks

    ticks = asyncio.run(go())
    assert ticks >= 20  # half a second of waiting writers, and the loop ticked through it
    assert _direct(path, "SELECT id, name FROM items ORDER BY id") == [
        (1, "a"),
        (2, "a again"),
        (12, "b"),
        (20, "lone"),
    ]


def test_a_writer_that_waits_past_the_timeout_gets_sqlites_error_and_the_turn_goes_on(path: Path) -> None:
    async def go() -> None:
        first = await sqlitedriver.connect(str(path), 0.2)
        second = await sqlitedriver.connect(str(path), 0.2)
        try:
            await first.run("BEGIN IMMEDIATE", None, None)
            await first.run("INSERT INTO items (id, name) VALUES (1, 'first')", None, None)
            with pytest.raises(sqlite3.OperationalError, match="database is locked"):
                await second.run("BEGIN IMMEDIATE", None, None)
            await first.commit()
            await second.run("BEGIN IMMEDIATE", None, None)  # its turn, once the first is done
            await second.run("INSERT INTO items (id, name) VALUES (2, 'second')", None, None)
            await second.commit()
        finally:
            await first.close()
            await second.close()

    asyncio.run(go())
    assert _direct(path, "SELECT id, name FROM items ORDER BY id") == [(1, "first"), (2, "second")]


def test_a_writer_cancelled_within_its_transaction_leaves_nothing_and_gives_its_turn_back(path: Path) -> None:
    async def go() -> None:
        engine = db.create_engine(sqlite_url(path))
        sessions = db.session_maker(engine)
        inside = asyncio.Event()

        async def stalled() -> None:
            async with sessions() as session, session.begin():
                await session.execute(text("INSERT INTO items (id, name) VALUES (1, 'cancelled')"))
                inside.set()
                await asyncio.sleep(60)

        try:
            task = asyncio.create_task(stalled())
            await inside.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            async with asyncio.timeout(5), sessions() as session, session.begin():
                await session.execute(text("INSERT INTO items (id, name) VALUES (2, 'next')"))
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert _direct(path, "SELECT id, name FROM items ORDER BY id") == [(2, "next")]
