"""Evaluations: accuracy by arm x family x wording, every recorded answer with its prompt, output and check, and
every arm's answer to one task side by side."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, get_args
from urllib.parse import urlencode

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server.httperrors import BadRequest
from server.protocol import recording
from server.settings import Settings
from server.store import listings, views
from server.web import answers, render
from server.web.gate import WebRequest

PAGE = 50
ROLES: tuple[str, ...] = get_args(wire.Role)
FAMILIES: tuple[str, ...] = get_args(wire.Family)
OUTCOMES = {"": None, "correct": True, "wrong": False}


@dataclass(frozen=True)
class Filters:
    """The answer browser's form, as the page's query string: an empty field means any."""

    role: str
    arm: str
    family: str
    variant: str
    outcome: str

    def check(self, arms: tuple[str, ...]) -> listings.AnswerFilter:
        for name, value, allowed in (
            ("role", self.role, ROLES),
            ("arm", self.arm, ("", *arms)),
            ("family", self.family, ("", *FAMILIES)),
            ("outcome", self.outcome, tuple(OUTCOMES)),
        ):
            if value not in allowed:
                raise BadRequest(f"{name} {value!r} is not one of {', '.join(repr(a) for a in allowed)}")
        if self.variant and not self.variant.isdigit():
            raise BadRequest(f"variant {self.variant!r} is not a wording number")
        return listings.AnswerFilter(
            arm=self.arm or None,
            role=self.role,
            family=self.family or None,
            variant=int(self.variant) if self.variant else None,
            correct=OUTCOMES[self.outcome],
        )

    def query(self, offset: int) -> str:
        fields = {"role": self.role, "arm": self.arm, "family": self.family, "variant": self.variant}
        return urlencode({**fields, "outcome": self.outcome, "offset": offset})


class EvaluationPages(Controller):
    path = "/experiments/{experiment_id:uuid}"

    @get("/evaluations")
    async def evaluations(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        role: FromQuery[str] = "test",
        arm: FromQuery[str] = "",
        family: FromQuery[str] = "",
        variant: FromQuery[str] = "",
        outcome: FromQuery[str] = "",
        offset: Annotated[int, QueryParameter(ge=0)] = 0,
    ) -> Template:
        experiment = await recording.load(db_session, experiment_id)
        arms = views.plan_of(experiment).arm_names()
        filters = Filters(role, arm, family, variant, outcome)
        page = await listings.answers(db_session, experiment_id, filters.check(arms), PAGE, offset)
        return render.page(
            request,
            "evaluations.html",
            tab="evaluations",
            experiment=experiment,
            grid=await answers.accuracy(db_session, experiment_id, arms, role),
            filters=filters,
            page=page,
            roles=ROLES,
            arms=arms,
            families=FAMILIES,
            outcomes=tuple(OUTCOMES),
        )

    @get("/tasks/{role:str}/{task_id:str}")
    async def task(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        role: FromPath[str],
        task_id: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Template:
        """Every arm's answer to one task side by side, under its prompt and expected answer."""
        if role not in ROLES:
            raise BadRequest(f"role {role!r} is not one of {', '.join(repr(r) for r in ROLES)}")
        experiment = await recording.load(db_session, experiment_id)
        found = await answers.task_answers(
            db_session, experiment_id, views.plan_of(experiment).arm_names(), role, task_id
        )
        first = found[0].answer
        task = await answers.prepared_task(db_session, settings, experiment_id, role, first.index, task_id)
        page: dict[str, object] = {"role": role, "first": first, "given": found, "task": task}
        return render.page(request, "task.html", tab="evaluations", experiment=experiment, **page)

    @get("/answers/{arm:str}/{role:str}/{task_id:str}")
    async def answer(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        arm: FromPath[str],
        role: FromPath[str],
        task_id: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Template:
        experiment = await recording.load(db_session, experiment_id)
        row, answer = await answers.answer(db_session, experiment_id, arm, role, task_id)
        task = await answers.prepared_task(db_session, settings, experiment_id, role, answer.index, task_id)
        return render.page(
            request, "answer.html", tab="evaluations", experiment=experiment, row=row, answer=answer, task=task
        )
