"""The experiment's path through the protocol, and every guard that refuses a step out of order (409 + rule)."""

from __future__ import annotations

from typing import Any

from experiment.core.ledger import Entry, verify_ledger
from tests.integration.coordinator.support import Api
from tests.support import ROOT
from tests.support.database import record_report
from tests.support.scenarios import (
    FINAL_STEP,
    bearer,
    experiment_through_testing,
    prepared_experiment,
    selection_body,
    sha,
    trained_experiment,
)


def refused(response: Any, rule: str) -> None:
    assert response.status_code == 409, response.text
    body = response.json()
    assert body["rule"] == rule, body
    assert body["detail"], body


def test_created_experiment_commits_its_plan_to_the_ledger(api: Api) -> None:
    experiment = api.create_experiment()
    assert experiment["state"] == "committed"
    ledger = api.get(f"/api/experiments/{experiment['id']}/ledger")
    assert [entry["kind"] for entry in ledger] == ["plan"]
    assert ledger[0]["identity"] == experiment["plan_identity"]
    assert ledger[0]["prev_hash"] == "0" * 64
    jobs = api.get(f"/api/experiments/{experiment['id']}/jobs")
    assert [(job["kind"], job["state"]) for job in jobs] == [("prepare", "queued")]
    arms = {arm["name"]: arm for arm in api.get(f"/api/experiments/{experiment['id']}/arms")}
    assert arms["clean-pair"]["world_size"] == 2 and arms["clean-pair"]["serving_eligible"]
    assert not arms["damaged-single"]["serving_eligible"]


def test_draft_experiment_waits_for_an_explicit_commit(api: Api) -> None:
    experiment = api.create_experiment(commit=False)
    assert experiment["state"] == "draft"
    assert api.get(f"/api/experiments/{experiment['id']}/ledger") == []
    committed = api.operator_post(f"/api/experiments/{experiment['id']}/commit", {})
    assert committed.status_code == 201 and committed.json()["state"] == "committed"
    refused(api.operator_post(f"/api/experiments/{experiment['id']}/commit", {}), "experiment-transition")


def test_training_refused_before_the_prepared_identity_is_committed(api: Api) -> None:
    experiment = api.create_experiment()
    response = api.operator_post(f"/api/experiments/{experiment['id']}/jobs", {"kind": "train", "arm": "clean-single"})
    refused(response, "training-requires-committed-prepared-identity")


def test_test_evaluation_refused_before_a_committed_selection(api: Api) -> None:
    a, b = api.agent("a"), api.agent("b")
    experiment = trained_experiment(api, a, b)
    response = api.operator_post(
        f"/api/experiments/{experiment['id']}/jobs", {"kind": "evaluate", "arm": "clean-single", "role": "test"}
    )
    refused(response, "test-evaluation-requires-committed-selection")


def test_selection_refused_before_every_arm_is_trained(api: Api) -> None:
    experiment = prepared_experiment(api, api.agent("a"))
    refused(
        api.operator_post(f"/api/experiments/{experiment['id']}/selection", selection_body()), "experiment-transition"
    )


def test_selection_takes_only_final_checkpoints_of_all_three_verified_arms(api: Api) -> None:
    a, b = api.agent("a"), api.agent("b")
    path = f"/api/experiments/{trained_experiment(api, a, b)['id']}/selection"
    missing = selection_body()
    del missing["arms"]["damaged-single"]
    refused(api.operator_post(path, missing), "selection-requires-all-three-arms")
    early = selection_body()
    early["arms"]["clean-pair"]["step"] = FINAL_STEP // 2
    refused(api.operator_post(path, early), "selection-final-checkpoints-only")
    other = selection_body()
    other["arms"]["clean-single"]["model_identity"] = sha("a better scoring checkpoint")
    refused(api.operator_post(path, other), "selection-must-match-verified-checkpoint")
    seed = selection_body()
    seed["arms"]["seed"] = {"step": FINAL_STEP, "model_identity": sha("seed")}
    refused(api.operator_post(path, seed), "selection-trained-arms-only")


def test_serving_refuses_the_damaged_arm_and_anything_but_the_selected_clean_pair(api: Api) -> None:
    experiment_id = experiment_through_testing(api, api.agent("a"), api.agent("b"))
    path = f"/api/experiments/{experiment_id}/serving"
    refused(
        api.operator_post(path, {"arm": "damaged-single", "model_identity": sha("damaged-single")}),
        "damaged-arm-never-served",
    )
    refused(
        api.operator_post(path, {"arm": "clean-single", "model_identity": sha("clean-single")}),
        "serving-clean-pair-only",
    )
    refused(
        api.operator_post(path, {"arm": "clean-pair", "model_identity": sha("step 64")}),
        "serving-selected-final-checkpoint-only",
    )
    served = api.operator_post(path, {"arm": "clean-pair", "model_identity": sha("clean-pair")})
    assert served.status_code == 201 and served.json()["state"] == "serving"


def test_full_protocol_leaves_a_verifiable_ledger_of_six_commitments(api: Api) -> None:
    a = api.agent("a")
    experiment_id = experiment_through_testing(api, a, api.agent("b"))
    path = f"/api/experiments/{experiment_id}/report"
    early = api.client.post(path, headers=bearer(api.operator))
    refused(early, "report-not-ready")
    api.operator_post(
        f"/api/experiments/{experiment_id}/serving", {"arm": "clean-pair", "model_identity": sha("clean-pair")}
    )
    # A report is only the coordinator's own computation: one sent by the operator is refused, and nothing changes.
    made_up = api.client.post(path, json={"verdict": "PASSED", "gain": 0.99}, headers=bearer(api.operator))
    assert made_up.status_code == 400 and "computes the report itself" in made_up.json()["detail"]
    refused(api.client.post(path, headers=bearer(api.operator)), "phase-running")  # its replicas never started
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "serving"
    assert api.client.get(path).status_code == 404
    assert api.home is not None
    record_report(api.url, api.home, experiment_id, {"verdict": "passed"})  # as the report job commits it
    ledger = api.get(f"/api/experiments/{experiment_id}/ledger")
    assert [e["kind"] for e in ledger] == ["plan", "prepared", "selection", "tested", "serving", "report"]
    verify_ledger([Entry(**entry) for entry in ledger])
    refused(
        api.operator_post(f"/api/experiments/{experiment_id}/jobs", {"kind": "evaluate", "arm": "seed", "role": "dev"}),
        "experiment-final",
    )
    # Serving jobs queued before the experiment ended (its replica starts, queued at selection) are never handed
    # out after it.
    assert a.claim() is None


def test_halted_experiment_takes_no_more_steps(api: Api) -> None:
    experiment = api.create_experiment()
    halted = api.operator_post(f"/api/experiments/{experiment['id']}/halt", {})
    assert halted.status_code == 201 and halted.json()["state"] == "halted"
    refused(api.operator_post(f"/api/experiments/{experiment['id']}/halt", {}), "experiment-transition")


def test_a_local_sgd_experiment_trains_four_rank_gangs_and_serves_nothing(api: Api) -> None:
    plan = (ROOT / "plans" / "local-diloco.toml").read_text()
    created = api.client.post("/api/experiments", json={"plan_toml": plan}, headers=bearer(api.operator))
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]
    arms = {arm["name"]: arm for arm in api.get(f"/api/experiments/{experiment_id}/arms")}
    assert {name: arm["world_size"] for name, arm in arms.items()} == {"seed": 1, "ddp-4": 4, "diloco-4": 4}
    assert not any(arm["serving_eligible"] for arm in arms.values())
    before = api.get(f"/api/experiments/{experiment_id}/jobs")
    replica = {"kind": "replica-start", "arm": "diloco-4", "spec": {"rank": 0}}
    refused(api.operator_post(f"/api/experiments/{experiment_id}/jobs", replica), "plan-serves-no-arm")
    serving = {"arm": "diloco-4", "model_identity": sha("diloco-4")}
    refused(api.operator_post(f"/api/experiments/{experiment_id}/serving", serving), "plan-serves-no-arm")
    refused(
        api.client.post(f"/api/experiments/{experiment_id}/report", headers=bearer(api.operator)), "report-not-ready"
    )
    assert api.get(f"/api/experiments/{experiment_id}/jobs") == before


def test_an_unstaged_plan_is_refused_naming_its_missing_hashes_and_nothing_is_recorded(api: Api) -> None:
    before = api.get("/api/experiments")
    plan = (ROOT / "plans" / "reference.toml").read_text()
    created = api.client.post("/api/experiments", json={"plan_toml": plan}, headers=bearer(api.operator))
    assert created.status_code == 400, created.text
    detail = created.json()["detail"]
    for field in ("seed.files", "seed.tokenizer_identity", "replay.replay.sha256", "replay.retention.sha256"):
        assert field in detail, detail
    assert api.get("/api/experiments") == before
