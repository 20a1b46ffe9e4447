"""The coordinator's own job: the report, recomputed by ``experiment.report`` from the stored evidence.

A queued report job is taken by the coordinator (never by an agent), the evidence bundle and ledger.json
are written under ``COOP_HOME/reports/EXPERIMENT/JOB/attempt-N/evidence``, the report is computed there in a worker
thread (report.json and report.html beside the bundle), and its identity is committed. A report that
fails a check fails the job with the report's message naming the file and field.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from experiment.canonical import write_new_bytes
from experiment.errors import CoopError
from server import evidence, experiments, models
from server.lifecycle import COORDINATOR_KIND, JobState, move_job
from server.settings import Settings

log = logging.getLogger("coop.server.reporter")
J = JobState


def report_dir(settings: Settings, experiment_id: uuid.UUID, job_id: uuid.UUID, attempt: int) -> Path:
    return settings.home / "reports" / str(experiment_id) / str(job_id) / f"attempt-{attempt}"


def _compute(members: list[evidence.Member], folder: Path) -> dict[str, Any]:
    from experiment.report import write_report  # torch and the tokenizer load only when a report runs

    bundle = folder / "evidence"
    for member in members:
        data = member.source if isinstance(member.source, bytes) else member.source.read_bytes()
        write_new_bytes(bundle / member.path, data)
    return write_report(bundle, folder / "report.json")


async def _take(session: AsyncSession) -> models.Job | None:
    job = await session.scalar(
        select(models.Job)
        .where(models.Job.kind == COORDINATOR_KIND, models.Job.state == J.QUEUED.value)
        .order_by(models.Job.queued_at)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    if job is not None:
        job.attempts_made += 1
        move_job(session, job, J.LEASED, "the coordinator took the report job")
        move_job(session, job, J.RUNNING, "recomputing the report from the stored evidence")
    return job


async def run_once(sessions: async_sessionmaker[AsyncSession], settings: Settings) -> bool:
    """Run one queued report job, if there is one; True when one ran (succeeded or failed)."""
    async with sessions() as session, session.begin():
        job = await _take(session)
        if job is None:
            return False
        job_id, experiment_id = job.id, job.experiment_id
        folder = report_dir(settings, experiment_id, job_id, job.attempts_made)
        members = await evidence.members(session, settings, experiment_id)
    try:
        report = await asyncio.to_thread(_compute, members, folder)
        failure = None
    except (CoopError, OSError) as exc:
        report, failure = {}, str(exc)
    async with sessions() as session, session.begin():
        experiment = await experiments.load(session, experiment_id, lock=True)
        job = await session.get_one(models.Job, job_id, with_for_update=True)
        if failure is None:
            await experiments.record_report(session, settings, experiment, report)
            move_job(session, job, J.SUCCEEDED, f"report written to {folder / 'report.json'}")
        else:
            log.error("report of experiment %s failed: %s", experiment_id, failure)
            move_job(session, job, J.FAILED, failure[:4000])
    return True


async def recover(sessions: async_sessionmaker[AsyncSession]) -> None:
    """A report job running when the coordinator stopped is queued again (its folder is per job and attempt)."""
    async with sessions() as session, session.begin():
        rows = await session.scalars(
            select(models.Job).where(models.Job.kind == COORDINATOR_KIND, models.Job.state == J.RUNNING.value)
        )
        for job in rows:
            move_job(session, job, J.QUEUED, "the coordinator restarted while the report ran")


async def loop(sessions: async_sessionmaker[AsyncSession], settings: Settings, every: float) -> None:
    await recover(sessions)
    while True:
        try:
            if await run_once(sessions, settings):
                continue
        except Exception:  # the loop must outlive one failed round (a dropped connection)
            log.exception("report round failed; retrying")
        await asyncio.sleep(every)
