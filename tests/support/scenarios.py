"""Experiments brought to a phase the way the protocol gets there: the operator's REST calls and fake agents'
steps (tests.support.agent), over any coordinator a test runs (the app in-process, or a real process)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import httpx

from experiment.core.plan import load_plan
from tests.support import ROOT
from tests.support.agent import FakeAgent, answer

LOCAL_PLAN = ROOT / "plans" / "local.toml"
FINAL_STEP = 128  # plans/local.toml: training.updates


class Operated(Protocol):
    """A coordinator as its operator reaches it: an HTTP client of it, the operator's token, and a read that
    must succeed."""

    @property
    def http(self) -> httpx.Client: ...

    @property
    def operator(self) -> str: ...

    def get(self, path: str) -> Any: ...


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def sha(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def operate(coordinator: Operated, path: str, body: dict[str, Any] | None = None) -> Any:
    """The operator's POST of ``body`` to ``path``, which the coordinator must accept; its reply."""
    response = coordinator.http.post(path, json=body, headers=bearer(coordinator.operator))
    assert response.status_code in {200, 201}, response.text
    return response.json()


def create_experiment(
    coordinator: Operated, plan: Path = LOCAL_PLAN, *, commit: bool = True, autopilot: bool = True
) -> dict[str, Any]:
    body = {"plan_toml": plan.read_text(), "commit": commit, "autopilot": autopilot}
    experiment: dict[str, Any] = operate(coordinator, "/api/experiments", body)
    return experiment


def train_result(arm: str) -> dict[str, Any]:
    """A train rank's result for the final checkpoint of ``arm``."""
    return {"step": FINAL_STEP, "model_identity": sha(arm), "receipt_sha256": sha(f"receipt {arm}"), "final": True}


def selection_body() -> dict[str, Any]:
    return {
        "arms": {
            arm: {"step": FINAL_STEP, "model_identity": sha(arm)}
            for arm in ("clean-single", "damaged-single", "clean-pair")
        }
    }


def prepared_experiment(coordinator: Operated, a: FakeAgent) -> dict[str, Any]:
    """A committed experiment (autopilot on) whose prepare job agent ``a`` ran: the prepared identity is committed
    and the three arms' training queued."""
    experiment = create_experiment(coordinator)
    prepare = a.take("prepare")
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    return experiment


def trained_experiment(coordinator: Operated, a: FakeAgent, b: FakeAgent) -> dict[str, Any]:
    """Prepared on a, and all three arms trained: the singles on a and b, the pair as a gang of a (rank 0) and b.
    Autopilot is switched off while the pair trains: from here on the tests drive each phase themselves (no dev
    evaluation or select job is queued)."""
    experiment = prepared_experiment(coordinator, a)
    for agent in (a, b):
        single = agent.take("train")
        agent.finish(single, result=train_result(str(single.arm)))
    rank0, rank1 = a.take("train"), b.take("train")
    assert (rank0.arm, rank0.rank, rank1.rank) == ("clean-pair", 0, 1), (rank0, rank1)
    off = operate(coordinator, f"/api/experiments/{experiment['id']}/autopilot", {"on": False})
    assert not off["autopilot"], off
    for agent, job in ((a, rank0), (b, rank1)):
        agent.finish(job, result=train_result("clean-pair"))
    return experiment


def select_and_advance(coordinator: Operated, experiment_id: str) -> None:
    """Commit the selection by REST, then the operator's advance queues the four test evaluations."""
    selected = operate(coordinator, f"/api/experiments/{experiment_id}/selection", selection_body())
    assert selected["state"] == "selected", selected
    advanced = operate(coordinator, f"/api/experiments/{experiment_id}/advance", {})
    assert advanced["action"].startswith("queued evaluate test"), advanced


def experiment_through_testing(coordinator: Operated, a: FakeAgent, b: FakeAgent) -> str:
    """A tested experiment: trained (trained_experiment: a holds the pair's rank 0, b its rank 1), the selection
    committed, and the four test evaluations recorded (the replica starts queued with them are left queued); its
    id."""
    experiment_id = str(trained_experiment(coordinator, a, b)["id"])
    select_and_advance(coordinator, experiment_id)
    for _ in load_plan(LOCAL_PLAN).arm_names():
        # A trained arm's evaluation is pinned to the host holding its checkpoint: either agent may get one.
        agent, job = next((agent, job) for agent in (a, b) if (job := agent.try_take("evaluate")) is not None)
        assert job.role == "test", job
        agent.evaluated(job, [answer(0, True)])
    assert coordinator.get(f"/api/experiments/{experiment_id}")["state"] == "tested"
    return experiment_id


DILOCO_PLAN = ROOT / "plans" / "local-diloco.toml"


def local_sgd_through_testing(coordinator: Operated, agents: list[FakeAgent]) -> str:
    """A tested experiment of the local-SGD plan (autopilot off): prepared on the first agent, ddp-4 and diloco-4
    each trained as a gang of the four agents, the selection committed by REST, and the three test evaluations
    recorded; its id."""
    experiment_id = str(create_experiment(coordinator, DILOCO_PLAN, autopilot=False)["id"])
    prepare = agents[0].take("prepare")
    agents[0].finish(prepare, result={"prepared_identity": sha("prepared")})
    advanced = operate(coordinator, f"/api/experiments/{experiment_id}/advance", {})
    assert advanced["action"] == "queued train ddp-4, train diloco-4", advanced
    for arm in ("ddp-4", "diloco-4"):
        ranks = [agent.take("train") for agent in agents]
        assert [(job.arm, job.rank) for job in ranks] == [(arm, rank) for rank in range(len(agents))], ranks
        for agent, job in zip(agents, ranks, strict=True):
            agent.finish(job, result=train_result(arm))
    body = {"arms": {arm: {"step": FINAL_STEP, "model_identity": sha(arm)} for arm in ("ddp-4", "diloco-4")}}
    selected = operate(coordinator, f"/api/experiments/{experiment_id}/selection", body)
    assert selected["state"] == "selected", selected
    advanced = operate(coordinator, f"/api/experiments/{experiment_id}/advance", {})
    assert advanced["action"].startswith("queued evaluate test"), advanced
    for _ in load_plan(DILOCO_PLAN).arm_names():
        agent, job = next((agent, job) for agent in agents if (job := agent.try_take("evaluate")) is not None)
        agent.evaluated(job, [answer(0, True)])
    assert coordinator.get(f"/api/experiments/{experiment_id}")["state"] == "tested"
    return experiment_id
