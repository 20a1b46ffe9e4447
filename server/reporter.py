"""The coordinator's own worker: it runs the report job, recomputed by ``experiment.report.recompute`` from the
stored evidence.

A report job is claimed through the queue like any job (an attempt row, a lease, the same start and finish), but
only by this worker, never by an agent (server.protocol.kinds: its kind is not run by agents). The evidence bundle and
ledger.json are written under ``COOP_HOME/reports/EXPERIMENT/JOB/attempt-N/evidence``, the report is computed there
in a worker thread (report.json and report.html beside the bundle) while the worker renews the attempt's lease,
and the report's blob is named in the attempt's result; the job's success commits it
(server.protocol.reactions). A report that fails a check fails the job with the report's message naming the file
and field. An attempt the coordinator was running when it stopped loses its lease and is retried like any lost
attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import uuid
from pathlib import Path

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from experiment import wire
from experiment.core.canonical import JsonObject, write_new_bytes
from experiment.core.errors import CoopError
from server import failpoints, models
from server.dispatch import queue, waiters
from server.protocol import kinds, reactions, recording
from server.settings import Settings
from server.store import evidencefiles

log = logging.getLogger("coop.server.reporter")


def report_dir(settings: Settings, experiment_id: uuid.UUID, job_id: uuid.UUID, attempt: int) -> Path:
    return settings.home / "reports" / str(experiment_id) / str(job_id) / f"attempt-{attempt}"


def _compute(members: list[evidencefiles.Member], folder: Path) -> JsonObject:
    from experiment.report.recompute import write_report  # torch and the tokenizer load only when a report runs

    bundle = folder / "evidence"
    for member in members:
        data = member.source if isinstance(member.source, bytes) else member.source.read_bytes()
        write_new_bytes(bundle / member.path, data)
    report: JsonObject = msgspec.to_builtins(write_report(bundle, folder / "report.json"))
    return report


async def _renew(sessions: async_sessionmaker[AsyncSession], settings: Settings, attempt_id: uuid.UUID) -> None:
    """Keep the attempt's lease while the report is computed (the reaper ends an attempt whose lease lapsed)."""
    while True:
        await asyncio.sleep(max(settings.lease_seconds / 3, 0.1))
        with contextlib.suppress(Exception):  # a missed renewal is retried; the lease has two more in it
            async with sessions() as session, session.begin():
                attempt = await session.get_one(models.Attempt, attempt_id, with_for_update=True)
                if attempt.state in queue.ACTIVE:
                    lease = datetime.timedelta(seconds=settings.lease_seconds)
                    attempt.lease_expires_at = datetime.datetime.now(datetime.UTC) + lease


async def run_once(sessions: async_sessionmaker[AsyncSession], settings: Settings) -> bool:
    """Run one queued report job, if there is one; True when one ran (succeeded or failed)."""
    async with sessions() as session, session.begin():
        assignment = await queue.claim(session, settings, None, kinds.BY_COORDINATOR)
        if assignment is None:
            return False
        await queue.start(session, None, assignment.attempt_id, assignment.lease_token)
        folder = report_dir(settings, assignment.experiment_id, assignment.job_id, assignment.number)
        members = await evidencefiles.members(session, settings, assignment.experiment_id)
    renewing = asyncio.create_task(_renew(sessions, settings, assignment.attempt_id))
    try:
        report = await asyncio.to_thread(_compute, members, folder)
        failpoints.reach("report.written")
        failure = None
    except (CoopError, OSError) as exc:
        report, failure = {}, str(exc)
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
    async with sessions() as session, session.begin():
        job, attempt = await queue.owned_attempt(session, None, assignment.attempt_id, assignment.lease_token)
        if failure is None:
            identity = await recording.store_report(session, settings, report)
            failpoints.reach("report.stored")
            result = wire.untagged(wire.ReportResult(report_identity=identity))
            reason = f"report written to {folder / 'report.json'}"
            await reactions.finish(session, settings, job, attempt, queue.Ending("succeeded", 0, reason, result))
        else:
            log.error("report of experiment %s failed: %s", assignment.experiment_id, failure)
            await reactions.finish(session, settings, job, attempt, queue.Ending("failed", reason=failure[:4000]))
    return True


async def loop(sessions: async_sessionmaker[AsyncSession], settings: Settings, woken: waiters.Claims) -> None:
    """Run report jobs as they are queued (woken like an agent's claim, server.dispatch.waiters)."""
    while True:
        ticket = woken.ticket()
        try:
            if await run_once(sessions, settings):
                continue
        except Exception:  # the loop must outlive one failed round (a dropped connection)
            log.exception("report round failed; retrying")
        await woken.wait(ticket, settings.claim_recheck_seconds)
