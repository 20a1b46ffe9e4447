"""Jobs: the experiment's queue (each job's phase or rank, hosts and duration) with a live timeline of the hosts'
work, each job's attempts (lost kept apart from failed) with the live tail of an attempt's log and the whole log as
a download, and the operator's cancel (a running replica is stopped from the serving page)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import partial

import anyio.to_thread
from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Stream, Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.states import JobState
from server import models
from server.access import auth
from server.dispatch.lifecycle import JOB_FINAL
from server.httperrors import NotFound
from server.protocol import actions, recording
from server.store import pages, views
from server.web import acting, gate, jobrows, render
from server.web.forms import Confirmed
from server.web.gate import WebRequest

TIMELINE_SECONDS = 5  # how often the page asks for the hosts' timeline again


def _final(job_state: JobState) -> bool:
    return job_state in JOB_FINAL


@dataclass(frozen=True)
class _Work:
    """What the queue and the timeline are drawn from, read once per request."""

    experiment: models.Experiment
    jobs: list[models.Job]
    attempts: list[pages.AttemptRow]
    changes: dict[uuid.UUID, list[pages.StateChange]]


async def _work(db_session: AsyncSession, experiment_id: uuid.UUID) -> _Work:
    return _Work(
        await recording.load(db_session, experiment_id),
        await pages.jobs(db_session, experiment_id),
        await pages.experiment_attempts(db_session, experiment_id),
        await pages.job_changes(db_session, experiment_id),
    )


def _queue(work: _Work) -> dict[str, object]:
    """The queue's rows, polled every two seconds."""
    rows = jobrows.rows(work.jobs, work.attempts, work.changes, render.now())
    return {
        "experiment": work.experiment,
        "waiting": [row for row in rows if not _final(row.job.state)],
        "finished": [row for row in rows if _final(row.job.state)],
    }


async def _timeline(work: _Work) -> dict[str, object]:
    """Every attempt on each host as a figure: polled less often than the queue, and drawn in a worker thread, since
    a figure takes a while to draw and would hold up every other request (an unchanged one comes from the cache)."""
    drawn = await anyio.to_thread.run_sync(jobrows.timeline, work.jobs, work.attempts, work.changes, render.now())
    return {"experiment": work.experiment, "timeline": drawn, "every": TIMELINE_SECONDS}


async def _job(db_session: AsyncSession, job_id: uuid.UUID, attempt_id: uuid.UUID | None) -> dict[str, object]:
    job = await views.found(db_session, models.Job, job_id)
    attempts = await pages.attempts(db_session, job_id)
    # The attempt whose log is shown: the one asked for, else the newest.
    if attempt_id is None:
        shown = attempts[0] if attempts else None
    else:
        shown = next((row for row in attempts if row.attempt.id == attempt_id), None)
    return {
        "job": job,
        "job_name": jobrows.name(job),
        "experiment": await recording.load(db_session, job.experiment_id),
        "attempts": attempts,
        "shown": shown,
        "log": await pages.log_tail(db_session, shown.attempt.id) if shown is not None else [],
        "log_size": await pages.log_size(db_session, shown.attempt.id) if shown is not None else 0,
        "live": not _final(job.state),
    }


class JobPages(Controller):
    path = "/"

    @get("/experiments/{experiment_id:uuid}/jobs")
    async def jobs(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        work = await _work(db_session, experiment_id)
        return render.page(request, "jobs.html", tab="jobs", **_queue(work) | await _timeline(work))

    @get("/experiments/{experiment_id:uuid}/jobs/live")
    async def jobs_live(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        return render.fragment(request, "fragments/jobs.html", **_queue(await _work(db_session, experiment_id)))

    @get("/experiments/{experiment_id:uuid}/jobs/timeline")
    async def timeline(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        work = await _work(db_session, experiment_id)
        return render.fragment(request, "fragments/timeline.html", **await _timeline(work))

    @get(["/jobs/{job_id:uuid}", "/jobs/{job_id:uuid}/live"])
    async def job(
        self,
        request: WebRequest,
        job_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        attempt: FromQuery[uuid.UUID | None] = None,
    ) -> Template:
        return render.page_or_live(request, "job.html", tab="jobs", **await _job(db_session, job_id, attempt))

    @get("/jobs/{job_id:uuid}/attempts/{attempt_id:uuid}/log")
    async def log(
        self,
        request: WebRequest,
        job_id: FromPath[uuid.UUID],
        attempt_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
    ) -> Stream:
        """The attempt's whole log as a text file, in the lines the page's tail shows, streamed a chunk at a time."""
        job = await views.found(db_session, models.Job, job_id)
        attempt = await views.found(db_session, models.Attempt, attempt_id)
        if attempt.job_id != job.id:
            raise NotFound(f"attempt {attempt_id} is not an attempt of job {job_id}")
        name = f"{job.kind}-{job.id}-attempt-{attempt.number}-rank-{attempt.rank}.log"
        return Stream(
            pages.log(auth.context(request).sessions, attempt.id),
            media_type="text/plain; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )

    @post("/jobs/{job_id:uuid}/cancel", opt=gate.ACTION)
    async def cancel(
        self, request: WebRequest, job_id: FromPath[uuid.UUID], data: Confirmed, operator: acting.Acting
    ) -> Redirect | Template:
        job = await operator.job(job_id)
        back = f"/jobs/{job.id}"
        explanation = (
            f"The {job.kind} job {job.id} ends as cancelled, which is final: a queued job is cancelled at "
            "once, a running one is asked to stop and is forced after 30 seconds. Queue a new job to run "
            "it again."
        )
        experiment = await recording.load(operator.session, job.experiment_id)
        ask = acting.Ask("Cancel this job?", explanation, "Cancel this job", "jobs", experiment, f"{back}/cancel")
        cancelling = partial(actions.cancel, operator, job, wire.CancelRequest().grace_seconds)
        message = f"asked job {job_id} to stop"
        return await acting.confirmed(request, operator, data, ask, cancelling, lambda _: message, back)
