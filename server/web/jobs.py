"""Jobs: the experiment's queue (each job's phase or rank, hosts and duration) with a timeline of the hosts' work,
each job's attempts (lost kept apart from failed) with the live tail of an attempt's log, and the operator's
cancel (a running replica is stopped from the serving page)."""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, URLEncodedBody
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import audit, experiments, queue, reactions
from server.lifecycle import JOB_FINAL, JobState, Refused
from server.settings import Settings
from server.web import access, jobrows, queries, render
from server.web.access import WebRequest
from server.web.forms import Confirmation


def _final(job_state: str) -> bool:
    return JobState(job_state) in JOB_FINAL


async def _queue(db_session: AsyncSession, experiment_id: uuid.UUID, *, hosts: bool = False) -> dict[str, Any]:
    """The queue's rows; with ``hosts``, the timeline of every attempt on each host too (the whole page draws it,
    the polled fragment does not: a figure every two seconds for each viewer is too much drawing)."""
    experiment = await experiments.load(db_session, experiment_id)
    jobs = await queries.jobs(db_session, experiment_id)
    attempts = await queries.experiment_attempts(db_session, experiment_id)
    changes = await queries.job_changes(db_session, experiment_id)
    at = render.now()
    rows = jobrows.rows(jobs, attempts, changes, at)
    found: dict[str, Any] = {
        "experiment": experiment,
        "waiting": [row for row in rows if not _final(row.job.state)],
        "finished": [row for row in rows if _final(row.job.state)],
    }
    if hosts:
        found["timeline"] = jobrows.timeline(jobs, attempts, changes, at)
    return found


async def _job(db_session: AsyncSession, job_id: uuid.UUID, attempt_id: uuid.UUID | None) -> dict[str, Any]:
    job = await queries.job(db_session, job_id)
    attempts = await queries.attempts(db_session, job_id)
    # The attempt whose log is shown: the one asked for, else the newest.
    if attempt_id is None:
        shown = attempts[0] if attempts else None
    else:
        shown = next((row for row in attempts if row.attempt.id == attempt_id), None)
    return {
        "job": job,
        "job_name": jobrows.name(job),
        "experiment": await experiments.load(db_session, job.experiment_id),
        "attempts": attempts,
        "shown": shown,
        "log": await queries.log_tail(db_session, shown.attempt.id) if shown is not None else [],
        "live": not _final(job.state),
    }


class JobPages(Controller):
    path = "/"

    @get("/experiments/{experiment_id:uuid}/jobs")
    async def jobs(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        return render.page(request, "jobs.html", tab="jobs", **await _queue(db_session, experiment_id, hosts=True))

    @get("/experiments/{experiment_id:uuid}/jobs/live")
    async def jobs_live(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        return render.fragment(request, "fragments/jobs.html", **await _queue(db_session, experiment_id))

    @get("/jobs/{job_id:uuid}")
    async def job(
        self,
        request: WebRequest,
        job_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        attempt: FromQuery[uuid.UUID | None] = None,
    ) -> Template:
        return render.page(request, "job.html", tab="jobs", **await _job(db_session, job_id, attempt))

    @get("/jobs/{job_id:uuid}/live")
    async def job_live(
        self,
        request: WebRequest,
        job_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        attempt: FromQuery[uuid.UUID | None] = None,
    ) -> Template:
        return render.fragment(request, "fragments/job.html", **await _job(db_session, job_id, attempt))

    @post("/jobs/{job_id:uuid}/cancel", opt=access.ACTION)
    async def cancel(
        self,
        request: WebRequest,
        job_id: FromPath[uuid.UUID],
        data: URLEncodedBody[Confirmation],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Redirect | Template:
        operator = access.operator(request)
        job = await queries.job(db_session, job_id, lock=True)
        what = "cancel this job"
        if data.confirm != "yes":
            return render.page(
                request,
                "confirm.html",
                tab="jobs",
                experiment=await experiments.load(db_session, job.experiment_id),
                title=f"{what.capitalize()}?",
                explanation=(
                    f"The {job.kind} job {job.id} ends as cancelled, which is final: a queued job is cancelled at "
                    "once, a running one is asked to stop and is forced after 30 seconds. Queue a new job to run "
                    "it again."
                ),
                action=f"/jobs/{job.id}/cancel",
                fields={},
                button=what.capitalize(),
                back=f"/jobs/{job.id}",
            )
        grace = wire.CancelRequest().grace_seconds
        try:
            await reactions.ended(db_session, settings, await queue.cancel(db_session, job, grace))
        except Refused as exc:
            return await access.refused(request, db_session, exc.detail, f"/jobs/{job_id}")
        audit.record(db_session, operator, "job.cancel", f"job:{job_id}", grace_seconds=grace)
        await db_session.commit()
        access.notify(request, f"asked job {job_id} to stop")
        return Redirect(f"/jobs/{job_id}", status_code=303)
