"""Evaluation reads for the UI: accuracy by arm x family x wording, one answer, every arm's answer to one task, and
the prepared task."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core import layout, tasks
from server import models
from server.httperrors import NotFound
from server.settings import Settings
from server.store import blobstore, evidencefiles, graded


@dataclass(frozen=True)
class Cell:
    correct: int = 0
    n: int = 0

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.n if self.n else None

    def __add__(self, other: Cell) -> Cell:
        return Cell(self.correct + other.correct, self.n + other.n)


@dataclass(frozen=True)
class Grid:
    """Accuracy by arm x family x wording (variant), with the totals by family and by arm."""

    arms: list[str]
    families: list[str]
    variants: list[int]
    cells: dict[tuple[str, str, int], Cell]

    def cell(self, arm: str, family: str, variant: int) -> Cell:
        return self.cells.get((arm, family, variant), Cell())

    def family(self, arm: str, family: str) -> Cell:
        return sum((self.cell(arm, family, v) for v in self.variants), Cell())

    def overall(self, arm: str) -> Cell:
        return sum((self.family(arm, f) for f in self.families), Cell())


async def accuracy(session: AsyncSession, experiment_id: uuid.UUID, arms: Sequence[str], role: str) -> Grid:
    """``arms`` in the order the grid lists them (the plan's, baseline first)."""
    found = await graded.counts(session, experiment_id, role)
    cells = {key: Cell(correct, n) for key, (n, correct) in found.items()}
    listed = [arm for arm in arms if any(key[0] == arm for key in cells)]
    families = [family for family in get_args(wire.Family) if any(key[1] == family for key in cells)]
    return Grid(listed, families, sorted({key[2] for key in cells}), cells)


async def answer(
    session: AsyncSession, experiment_id: uuid.UUID, arm: str, role: str, task_id: str
) -> tuple[models.Answer, wire.Answer]:
    row = await graded.one(session, experiment_id, arm, role, task_id)
    if row is None:
        raise NotFound(f"no {role} answer of {arm} to task {task_id} is recorded")
    return row, msgspec.convert(row.body, type=wire.Answer)


@dataclass(frozen=True)
class ArmAnswer:
    arm: str
    row: models.Answer
    answer: wire.Answer


async def task_answers(
    session: AsyncSession, experiment_id: uuid.UUID, arms: Sequence[str], role: str, task_id: str
) -> list[ArmAnswer]:
    """Every recorded answer to the task, one per arm, in ``arms``' order (the plan's, baseline first); NotFound
    where no arm answered it."""
    rows = await graded.of_tasks(session, experiment_id, role, [task_id], None)
    found = {row.arm: row for row in rows}
    if not found:
        raise NotFound(f"no arm's {role} answer to task {task_id} is recorded")
    # An arm the plan does not name (recorded by an older plan's jobs) still shows, after the plan's.
    order = [arm for arm in arms if arm in found] + sorted(found.keys() - set(arms))
    return [ArmAnswer(arm, found[arm], msgspec.convert(found[arm].body, type=wire.Answer)) for arm in order]


class PreparedTask(msgspec.Struct, frozen=True):
    """The fields of a prepared task line (experiment.learning.corpus.TaskItem) the answer page shows."""

    id: str
    prompt: str
    expected: tasks.ExpectedAnswer


# The prepared role files in the evidence bundle (experiment.learning.corpus.ROLE_FILES under prepared/); importing
# experiment.learning.corpus would load a seed's tokenizer library into the coordinator.
ROLE_FILES = {role: f"{layout.PREPARED}/{role}.jsonl" for role in ("dev", "test")}


async def prepared_task(
    session: AsyncSession, settings: Settings, experiment_id: uuid.UUID, role: str, index: int, task_id: str
) -> PreparedTask | None:
    """The task's prompt and expected answer, where the prepare job uploaded its role file; else None."""
    path = ROLE_FILES.get(role)
    listed = next((f for f in await evidencefiles.listing(session, experiment_id) if f.path == path), None)
    if listed is None:
        return None
    _, file = await blobstore.find(session, settings, listed.sha256)
    with file.open("rb") as lines:
        line = next((line for number, line in enumerate(lines) if number == index), None)
    if line is None:
        return None
    try:
        task = msgspec.json.decode(line, type=PreparedTask)
    except msgspec.MsgspecError:
        return None  # a role file in another shape: the pages show the prompt's token ids instead
    return task if task.id == task_id else None
