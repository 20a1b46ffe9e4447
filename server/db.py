"""The database engine: SQLite in WAL mode with a busy timeout, or Postgres; one session maker."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.pool import ConnectionPoolEntry

from experiment.core.errors import CoopError
from server import sqlitedriver

SQLITE_BUSY_TIMEOUT_MS = 30_000
MIGRATE_FIRST = "run `coop-server migrate` first (the coordinator's unit runs it at each start)"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def _sqlite_pragmas(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    # WAL lets readers run beside the one writer; busy_timeout makes concurrent writers queue
    # instead of failing; foreign keys are off by default in SQLite.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


# session.info key: False makes the session's SQLite transactions readers (a deferred BEGIN, no write lock).
WRITES = "coop.writes"


# session.info key: True while the session's SQLite transactions run one statement each, which SQLite runs in a
# transaction of its own (autocommit): no BEGIN is sent for them.
ONE_STATEMENT = "coop.one-statement"


def _sqlite_begin(session: Session, transaction: SessionTransaction, connection: Connection) -> None:
    """Begin each SQLite transaction a session starts: a writer takes the write lock at BEGIN IMMEDIATE, where
    busy_timeout makes a second writer wait its turn; a reader (``session.info[WRITES] = False``) begins a
    deferred transaction, which in WAL mode reads a snapshot and never takes the write lock."""
    if connection.dialect.name != "sqlite" or transaction.nested or session.info.get(ONE_STATEMENT):
        return
    connection.exec_driver_sql("BEGIN IMMEDIATE" if session.info.get(WRITES, True) else "BEGIN")


def reading(session: AsyncSession) -> None:
    """Make the session's next transactions readers (a writer is the default)."""
    session.info[WRITES] = False


def writing(session: AsyncSession) -> None:
    session.info[WRITES] = True


def one_statement(session: AsyncSession, alone: bool) -> None:
    """While ``alone``, the session's next transactions are single reads: on SQLite they send no BEGIN."""
    if alone:
        session.info[ONE_STATEMENT] = True
    else:
        session.info.pop(ONE_STATEMENT, None)


async def read_alone(session: AsyncSession) -> None:
    """Begin the session's transaction for one read. On Postgres its connection autocommits for that transaction,
    so the read goes without a BEGIN and a COMMIT, two round trips; the pool sets the connection back when it
    returns. On SQLite ``one_statement`` does the same."""
    if session.get_bind().dialect.name == "postgresql":
        await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})


def create_engine(url: str, **options: Any) -> AsyncEngine:
    if not (url.startswith("sqlite+aiosqlite") or url.startswith("postgresql+asyncpg")):
        raise CoopError(f"unsupported database URL {url!r}: use sqlite+aiosqlite:///PATH or postgresql+asyncpg://...")
    if is_sqlite(url):
        path = make_url(url).database or ""
        engine = create_async_engine(
            url,
            async_creator=partial(sqlitedriver.connect, path, SQLITE_BUSY_TIMEOUT_MS / 1000),
            **options,
        )
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    # No ping at checkout: on asyncpg it is three round trips, paid twice a request. A connection the server has
    # dropped (a restart) fails the one request that meets it, answered 503 (server.app), and marks every connection
    # the pool made before it to be made anew at its next checkout.
    return create_async_engine(url, pool_size=20, max_overflow=20, **options)


event.listen(Session, "after_begin", _sqlite_begin)


def session_maker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def describe(url: str) -> str:
    """The URL without its password, for messages."""
    return make_url(url).render_as_string(hide_password=True)


async def require_migrated(url: str) -> None:
    """Refuse (CoopError) a database that ``coop-server migrate`` has not made: a SQLite file that does not exist is
    not created, and a database without an alembic revision is not written to."""
    if is_sqlite(url) and not Path(url.split("///", 1)[1]).exists():
        raise CoopError(f"{describe(url)} does not exist yet: {MIGRATE_FIRST}")
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            found = await connection.run_sync(lambda sync: inspect(sync).has_table("alembic_version"))
    except (OSError, SQLAlchemyError) as exc:
        raise CoopError(f"{describe(url)} does not answer: {exc}") from exc
    finally:
        await engine.dispose()
    if not found:
        raise CoopError(f"{describe(url)} was never migrated: {MIGRATE_FIRST}")
