"""The recorded answers, graded, as the pages read them: the counts by arm, family and wording, one arm's answer to a
task, every arm's answers to tasks, and two arms' outcomes on the items both answered."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server import models

# (arm, family, variant): (answered, right)
Counts = dict[tuple[str, str, int], tuple[int, int]]


async def counts(session: AsyncSession, experiment_id: uuid.UUID, role: str) -> Counts:
    """How many of the role's tasks each arm answered, and answered right, by family and wording (variant)."""
    rows = await session.execute(
        select(
            models.Answer.arm,
            models.Answer.family,
            models.Answer.variant,
            func.count(models.Answer.id),
            func.sum(case((models.Answer.correct, 1), else_=0)),
        )
        .where(models.Answer.experiment_id == experiment_id, models.Answer.role == role)
        .group_by(models.Answer.arm, models.Answer.family, models.Answer.variant)
    )
    return {(arm, family, variant): (int(n), int(correct)) for arm, family, variant, n, correct in rows}


async def one(
    session: AsyncSession, experiment_id: uuid.UUID, arm: str, role: str, task_id: str
) -> models.Answer | None:
    return await session.scalar(
        select(models.Answer).where(
            models.Answer.experiment_id == experiment_id,
            models.Answer.arm == arm,
            models.Answer.role == role,
            models.Answer.task_id == task_id,
        )
    )


async def of_tasks(
    session: AsyncSession, experiment_id: uuid.UUID, role: str, task_ids: Sequence[str], arms: Sequence[str] | None
) -> list[models.Answer]:
    """The recorded answers to the tasks, by every arm or by ``arms``' only."""
    chosen = () if arms is None else (models.Answer.arm.in_(arms),)
    rows = await session.scalars(
        select(models.Answer).where(
            models.Answer.experiment_id == experiment_id,
            models.Answer.role == role,
            models.Answer.task_id.in_(task_ids),
            *chosen,
        )
    )
    return list(rows)


async def outcomes(
    session: AsyncSession, experiment_id: uuid.UUID, role: str, arms: Sequence[str]
) -> dict[str, dict[str, tuple[int, bool]]]:
    """Arm -> task id -> (the task's index, whether the arm answered it right), for each of ``arms``."""
    rows = await session.execute(
        select(models.Answer.arm, models.Answer.task_id, models.Answer.task_index, models.Answer.correct).where(
            models.Answer.experiment_id == experiment_id,
            models.Answer.role == role,
            models.Answer.arm.in_(arms),
        )
    )
    found: dict[str, dict[str, tuple[int, bool]]] = {arm: {} for arm in arms}
    for arm, task_id, index, correct in rows:
        found[arm][task_id] = (index, correct)
    return found
