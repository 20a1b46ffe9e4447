"""Migrations build the schema from empty, match the models exactly, come down again, and keep the rows they
find."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from experiment.core.states import ExperimentState, JobState
from server import db, migrate, models
from server.settings import sqlite_url
from tests.support import database


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "empty.sqlite3")
        return
    admin = database.postgres_admin_url()
    url = database.create_postgres_database(admin)
    if url is None:
        pytest.fail(f"no Postgres server answers at {admin}: run `make services` (as root)")
    try:
        yield url
    finally:
        database.drop_postgres_database(admin, url)


def test_migrations_from_empty_match_the_models_and_downgrade(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    migrate.check(empty_url)  # raises when autogenerate would find a difference
    migrate.downgrade(empty_url, "base")
    migrate.upgrade(empty_url)
    migrate.check(empty_url)


def test_the_state_checks_keep_every_row_and_refuse_an_unknown_state(empty_url: str) -> None:
    """The revision that puts CHECKs on the state columns rebuilds SQLite's tables: an experiment, its job, the
    job's attempt and the attempt's event, written before it, are all there after it, as they were."""
    migrate.upgrade(empty_url, "8f4a5b6c7d8e")
    now = datetime.datetime.now(datetime.UTC)

    async def write() -> tuple[uuid.UUID, ...]:
        engine = db.create_engine(empty_url)
        try:
            async with async_sessionmaker(engine, expire_on_commit=False)() as session:
                experiment = models.Experiment(
                    name="kept", state=ExperimentState.TRAINING, plan_toml="", plan={}, plan_identity="0" * 64
                )
                session.add(experiment)
                await session.flush()
                job = models.Job(
                    experiment_id=experiment.id,
                    kind="train",
                    spec={},
                    world_size=1,
                    state=JobState.RUNNING,
                    max_attempts=3,
                    ranks_open=0,
                    queued_at=now,
                )
                session.add(job)
                await session.flush()
                attempt = models.Attempt(
                    job_id=job.id,
                    number=1,
                    rank=0,
                    state=JobState.RUNNING,
                    lease_token_hash="0" * 64,
                    lease_expires_at=now,
                )
                session.add(attempt)
                await session.flush()
                event = models.Event(
                    experiment_id=experiment.id,
                    job_id=job.id,
                    attempt_id=attempt.id,
                    kind="step",
                    at=now,
                    body={"step": 1},
                )
                session.add(event)
                await session.commit()
                return experiment.id, job.id, attempt.id, event.id
        finally:
            await engine.dispose()

    async def read() -> dict[str, list[tuple[object, ...]]]:
        engine = db.create_engine(empty_url)
        try:
            async with engine.connect() as connection:
                tables = {}
                for table in ("experiments", "jobs", "attempts", "events"):
                    state = "state" if table != "events" else "kind"
                    rows = await connection.exec_driver_sql(f"SELECT id, {state} FROM {table}")
                    tables[table] = [tuple(row) for row in rows]
                return tables
        finally:
            await engine.dispose()

    async def refused(statement: str) -> bool:
        engine = db.create_engine(empty_url)
        try:
            async with engine.begin() as connection:
                await connection.exec_driver_sql(statement)
        except IntegrityError:
            return True
        finally:
            await engine.dispose()
        return False

    ids = asyncio.run(write())
    before = asyncio.run(read())
    migrate.upgrade(empty_url)
    after = asyncio.run(read())
    assert after == before
    assert [len(after[table]) for table in ("experiments", "jobs", "attempts", "events")] == [1, 1, 1, 1]
    assert {row[1] for row in after["jobs"] + after["attempts"]} == {"running"} and len(ids) == 4
    for table in ("experiments", "jobs", "attempts"):
        assert asyncio.run(refused(f"UPDATE {table} SET state = 'stuck'")), table
    assert asyncio.run(read()) == after
