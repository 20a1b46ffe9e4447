"""The canary gate: a plan that trains on a GPU is committed only once its canary passed on every host of its gang
(experiment.serving.canary), or with an operator's override. Either way the plan's commitment records it, so the
ledger and the evidence say what the paid run was committed on (docs/operating.md, "The canary").

A CPU plan passes the gate without a canary: its every step runs in the tests, on this code, and a rerun costs
nothing. Its canary may still run (CI and the rehearsal run one), and is recorded the same way when it passed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.canonical import Json, JsonObject
from experiment.core.plan import Plan
from experiment.core.states import JobState
from server import models
from server.dispatch import queue
from server.dispatch.lifecycle import JOB_ACTIVE, Refused


@dataclass(frozen=True)
class Host:
    """One rank of a canary: the agent that ran it, and its result (None while it has none)."""

    rank: int
    agent: str
    state: JobState
    result: wire.CanaryResult | None
    reason: str | None


@dataclass(frozen=True)
class Verdict:
    """The experiment's latest canary job, rank by rank."""

    job: models.Job
    hosts: list[Host]

    @property
    def passed(self) -> bool:
        return (
            self.job.state == JobState.SUCCEEDED
            and len(self.hosts) == self.job.world_size
            and all(host.result is not None and host.result.passed for host in self.hosts)
        )

    def failures(self) -> list[str]:
        """Each failed step, named with its host and its fix; else why the job itself did not pass."""
        found = []
        for host in self.hosts:
            if host.result is None:
                if host.reason:
                    found.append(f"{host.agent} (rank {host.rank}): {host.state}: {host.reason}")
                continue
            for step in host.result.steps:
                if not step.passed:
                    found.append(f"{host.agent} (rank {host.rank}) step {step.name}: {step.failure} (fix: {step.fix})")
        if not found and not self.passed:
            found.append(f"the canary job is {self.job.state}")
        return found


async def latest(session: AsyncSession, experiment_id: uuid.UUID) -> Verdict | None:
    """The experiment's newest canary job and what each of its ranks reported (None: no canary was queued)."""
    job = await session.scalar(
        select(models.Job)
        .where(models.Job.experiment_id == experiment_id, models.Job.kind == "canary")
        .order_by(models.Job.queued_at.desc())
        .limit(1)
    )
    if job is None:
        return None
    hosts = []
    for attempt in await queue.generation(session, job):
        agent = None if attempt.agent_id is None else await session.get(models.Agent, attempt.agent_id)
        result = None
        if attempt.state == JobState.SUCCEEDED and attempt.result is not None:
            result = wire.decode(attempt.result, wire.CanaryResult)
        hosts.append(
            Host(
                rank=attempt.rank,
                agent="(unclaimed)" if agent is None else agent.name,
                state=attempt.state,
                result=result,
                reason=attempt.reason,
            )
        )
    return Verdict(job, hosts)


def view(verdict: Verdict) -> wire.Canary:
    hosts = [
        wire.CanaryHost(
            rank=host.rank,
            agent=host.agent,
            state=host.state,
            reason=host.reason,
            passed=None if host.result is None else host.result.passed,
            steps=[] if host.result is None else host.result.steps,
        )
        for host in verdict.hosts
    ]
    done = verdict.job.state not in {JobState.QUEUED, *JOB_ACTIVE}
    failures = verdict.failures() if done else []
    return wire.Canary(
        job_id=verdict.job.id, state=verdict.job.state, passed=verdict.passed, hosts=hosts, failures=failures
    )


def _record(verdict: Verdict) -> JsonObject:
    """What the plan's commitment keeps of a passed canary: the job, and each host's steps with their figures."""
    return {
        "job": str(verdict.job.id),
        "passed": True,
        "hosts": [
            {"rank": host.rank, "agent": host.agent, "steps": wire.untagged(host.result)["steps"]}
            for host in verdict.hosts
            if host.result is not None
        ],
    }


async def gate(
    session: AsyncSession, experiment: models.Experiment, plan: Plan, override: str | None
) -> JsonObject | None:
    """What the plan's commitment records of the canary (None: nothing, a CPU plan committed without one); refuses
    a GPU plan without a passed canary unless the operator overrides it, and any plan while its canary runs."""
    verdict = await latest(session, experiment.id)
    if verdict is not None and verdict.job.state in {JobState.QUEUED, *JOB_ACTIVE}:
        raise Refused(
            "canary-running", f"the canary job {verdict.job.id} is {verdict.job.state}: wait for it, or cancel it"
        )
    if verdict is not None and verdict.passed:
        return _record(verdict)
    if override is not None:
        failures: list[Json] = [] if verdict is None else list(verdict.failures())
        return {"passed": False, "override": override, "failures": failures}
    if plan.runtime.device == "cpu":
        return None
    if verdict is None:
        detail = "no canary ran for this plan"
    else:
        detail = "its canary did not pass: " + "; ".join(verdict.failures())
    raise Refused(
        "canary-required",
        f"plan {plan.name} trains on {plan.runtime.device} and {detail}. Run `coop-server experiment canary "
        f"{experiment.id}` until it passes, or commit with an override the ledger records "
        "(`--override-canary REASON`)",
    )
