"""The report's paired comparisons item by item: for the primary test, each descriptive comparison and a local-SGD
plan's non-inferiority test, the test items exactly one of the two arms answers right (the wins and the losses),
read from the recorded answers and set beside the counts the report states."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.report.model import Comparison, Primary, Report
from server.httperrors import NotFound
from server.store import graded

ROLE = "test"  # every paired comparison of the report is on the final test items


@dataclass(frozen=True)
class Stated:
    """A paired comparison as the report states it: wins are items ``arm`` answers right and ``baseline`` wrong."""

    title: str
    baseline: str
    arm: str
    wins: int
    losses: int
    n: int
    part: str  # where the report states it: "primary", "descriptive" or "non-inferiority"

    @property
    def path(self) -> str:
        """The comparison's page, below the experiment's report."""
        return f"compare/{self.arm}/vs/{self.baseline}"


def stated(report: Report) -> list[Stated]:
    """Every paired comparison the report states, in the order the report page shows them."""
    counted: list[tuple[str, Primary | Comparison, str]] = []
    if report.primary is not None:
        counted.append((report.primary.comparison, report.primary, "primary"))
    if report.descriptive is not None:
        counted.extend((comparison.name, comparison, "descriptive") for comparison in report.descriptive.comparisons)
    found = [
        Stated(title, c.baseline, c.arm, c.paired.wins, c.paired.losses, c.paired.n, part) for title, c, part in counted
    ]
    if report.local_sgd is not None:
        test = report.local_sgd.noninferiority
        title = f"{test.arm} vs {test.control}, non-inferiority"
        found.append(Stated(title, test.control, test.arm, test.wins, test.losses, test.n, "non-inferiority"))
    return found


def find(report: Report, arm: str, baseline: str) -> Stated:
    """The report's comparison of ``arm`` against ``baseline``; NotFound naming the ones it states otherwise."""
    listed = stated(report)
    found = next((c for c in listed if c.arm == arm and c.baseline == baseline), None)
    if found is None:
        named = "; ".join(f"{c.arm} vs {c.baseline}" for c in listed) or "none"
        raise NotFound(f"the report states no paired comparison of {arm} against {baseline} (it states: {named})")
    return found


@dataclass(frozen=True)
class Item:
    """One discordant test item: the task and both arms' answers to it."""

    task_id: str
    index: int
    family: str
    variant: int
    baseline: wire.Answer
    arm: wire.Answer


@dataclass(frozen=True)
class Discordant:
    wins: list[Item]  # ``arm`` right, ``baseline`` wrong, in task order
    losses: list[Item]  # ``baseline`` right, ``arm`` wrong
    paired: int  # items both arms answered
    unpaired: int  # items only one of them answered: a comparison over unequal sets is not the report's

    def agrees(self, comparison: Stated) -> bool:
        return (len(self.wins), len(self.losses), self.paired, self.unpaired) == (
            comparison.wins,
            comparison.losses,
            comparison.n,
            0,
        )


async def discordant(session: AsyncSession, experiment_id: uuid.UUID, baseline: str, arm: str) -> Discordant:
    """The recorded test answers of the two arms, paired by task: where exactly one of them is right."""
    outcomes = await graded.outcomes(session, experiment_id, ROLE, [baseline, arm])
    theirs, ours = outcomes[baseline], outcomes[arm]
    both = theirs.keys() & ours.keys()
    differing = sorted((ours[task][0], task) for task in both if theirs[task][1] != ours[task][1])
    bodies = await _answers(session, experiment_id, [baseline, arm], [task for _, task in differing])
    wins: list[Item] = []
    losses: list[Item] = []
    for index, task in differing:
        mine = bodies[arm, task]
        item = Item(task, index, mine.family, mine.variant, bodies[baseline, task], mine)
        (wins if ours[task][1] else losses).append(item)
    return Discordant(
        wins=wins,
        losses=losses,
        paired=len(both),
        unpaired=len(theirs.keys() ^ ours.keys()),
    )


async def _answers(
    session: AsyncSession, experiment_id: uuid.UUID, arms: list[str], task_ids: list[str]
) -> dict[tuple[str, str], wire.Answer]:
    """(arm, task id) -> the recorded answer, for the discordant items only: their bodies are what the page shows."""
    if not task_ids:
        return {}
    rows = await graded.of_tasks(session, experiment_id, ROLE, task_ids, arms)
    return {(row.arm, row.task_id): msgspec.convert(row.body, type=wire.Answer) for row in rows}
