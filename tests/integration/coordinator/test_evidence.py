"""Blobs are stored by content (verified, idempotent, bounded) and the evidence bundle is exported as a tar
of the blobs each job named, plus the commitment ledger."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from experiment import wire
from experiment.core.canonical import canonical_bytes, sha256_bytes
from experiment.core.errors import CoopError
from experiment.core.layout import ATTEMPTS
from experiment.core.ledger import decode_ledger, verify_ledger
from experiment.report.attempts import arm_faults, read_attempts
from server.settings import Settings
from tests.integration.coordinator.support import Api, running
from tests.support.agent import FakeAgent, rejection
from tests.support.scenarios import FINAL_STEP, bearer, prepared_experiment, select_and_advance, sha, train_result
from tests.support.waiting import wait_for


def require(condition: bool, where: Path | str, field: str, problem: str) -> None:
    if not condition:
        raise CoopError(f"{where}: {field}: {problem}")


def _put(api: Api, token: str, data: bytes, name: str | None = None, job: wire.Assignment | None = None) -> Any:
    """A raw upload as the operator, or as an agent naming the attempt ``job`` whose evidence it is, under the
    name ``name`` (its sha256 unless given) and a content type the coordinator must not keep."""
    digest = name or hashlib.sha256(data).hexdigest()
    query = f"?attempt={job.attempt_id}" if job is not None else ""
    return api.client.put(
        f"/api/blobs/{digest}{query}", content=data, headers={**bearer(token), "Content-Type": "text/html"}
    )


def test_blob_upload_is_verified_idempotent_and_downloadable(api: Api, tmp_path: Path) -> None:
    a = api.agent("a")
    api.create_experiment()
    job = a.claim()
    assert job is not None
    data = b'<script>alert("a blob")</script>\n'
    digest = hashlib.sha256(data).hexdigest()
    first = _put(api, a.token, data, job=job)
    # The uploader's content type is not kept: a blob is data.
    assert first.status_code == 201 and first.json() == {
        "sha256": digest,
        "size": len(data),
        "media_type": "application/octet-stream",
        "created": True,
    }
    again = _put(api, api.operator, data)
    assert again.status_code == 200 and again.json()["created"] is False
    stored = tmp_path / "blobs" / digest[:2] / digest
    assert stored.read_bytes() == data
    download = api.client.get(f"/api/blobs/{digest}")
    assert download.status_code == 200 and download.content == data
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.headers["x-content-type-options"] == "nosniff"
    assert download.headers["content-disposition"].startswith("attachment")
    mismatch = _put(api, a.token, b"other bytes", name=digest, job=job)
    assert mismatch.status_code == 400 and "sha256" in mismatch.json()["detail"]
    assert stored.read_bytes() == data  # never overwritten
    assert _put(api, a.token, data, name="not-a-digest", job=job).status_code == 400
    assert api.client.put(f"/api/blobs/{digest}", content=data).status_code == 401
    assert api.client.get(f"/api/blobs/{sha('never uploaded')}").status_code == 404
    assert not list((tmp_path / "blobs" / ".incoming").iterdir())


def test_oversized_blob_is_413_and_leaves_nothing(make_settings: Callable[..., Settings], database_url: str) -> None:
    settings = make_settings(max_blob_bytes=4096)
    with running(settings) as client:
        api = Api(client, database_url)
        data = b"x" * 5000
        assert _put(api, api.operator, data).status_code == 413
        assert api.client.get(f"/api/blobs/{hashlib.sha256(data).hexdigest()}").status_code == 404
        assert _put(api, api.operator, data[:4096]).status_code == 201
        assert not list((settings.blob_dir / ".incoming").iterdir())


def _files(prefix: str, names: tuple[str, ...]) -> dict[str, bytes]:
    return {f"{prefix}{name}": canonical_bytes({"file": f"{prefix}{name}"}) + b"\n" for name in names}


def test_evidence_tar_holds_every_named_blob_and_a_verifiable_ledger(api: Api) -> None:
    a, b = api.agent("a"), api.agent("b")
    uploaded: dict[str, bytes] = {}

    def upload(agent: FakeAgent, files: dict[str, bytes], job: wire.Assignment) -> dict[str, str]:
        """Evidence files of the attempt ``job``, uploaded by its agent: bundle path -> sha256."""
        uploaded.update(files)
        return {path: agent.upload(data, job) for path, data in files.items()}

    def by_operator(files: dict[str, bytes]) -> dict[str, str]:
        named = {}
        for path, data in files.items():
            assert _put(api, api.operator, data).status_code in {200, 201}
            named[path] = hashlib.sha256(data).hexdigest()
        uploaded.update(files)
        return named

    experiment = api.create_experiment()
    experiment_id = experiment["id"]
    prepare = a.claim()
    assert prepare is not None
    prepared = upload(
        a,
        _files("prepared/", ("plan.json", "manifest.json", "test.jsonl")) | _files("seed/", ("tokenizer.json",)),
        prepare,
    )
    a.finish(prepare, result={"prepared_identity": sha("prepared")}, evidence=prepared)
    for agent in (a, b):
        job = agent.claim()
        assert job is not None and job.kind == "train" and job.arm is not None
        outside = upload(agent, _files("prepared/", ("x",)), job)
        refused = rejection(agent.finish, job, result=train_result(job.arm), evidence=outside)
        assert refused.status_code == 409 and refused.rule == "evidence-outside-job"
        uploaded.pop("prepared/x")
        runs = upload(agent, _files(f"runs/{job.arm}/rank-0/", ("result.json", "run.json")), job)
        agent.finish(job, result=train_result(job.arm), evidence=runs)
    ranks = [a.claim(), b.claim()]
    assert api.operator_post(f"/api/experiments/{experiment_id}/autopilot", {"on": False}).status_code == 200
    for agent, job in zip((a, b), ranks, strict=True):
        assert job is not None
        runs = upload(agent, _files(f"runs/clean-pair/rank-{job.rank}/", ("result.json", "run.json")), job)
        agent.finish(job, result=train_result("clean-pair"), evidence=runs)
    select_and_advance(api, experiment_id)
    # The committed selection is the bundle's selection.json, written by the coordinator; it is never replaced.
    committed = next(e for e in api.get(f"/api/experiments/{experiment_id}/ledger") if e["kind"] == "selection")
    assert sha256_bytes(canonical_bytes(committed["body"])) == committed["identity"]
    conflict = api.operator_post(
        f"/api/experiments/{experiment_id}/evidence", {"files": by_operator({"selection.json": b"{}\n"})}
    )
    assert conflict.status_code == 409 and conflict.json()["rule"] == "evidence-path-conflict"
    uploaded["selection.json"] = canonical_bytes(committed["body"]) + b"\n"
    missing = api.operator_post(f"/api/experiments/{experiment_id}/evidence", {"files": {"serving/x.json": sha("x")}})
    assert missing.status_code == 409 and missing.json()["rule"] == "evidence-blob-not-uploaded"
    dotted = api.operator_post(f"/api/experiments/{experiment_id}/evidence", {"files": {"runs/../x": sha("x")}})
    assert dotted.status_code == 400

    response = api.client.get(f"/api/experiments/{experiment_id}/evidence.tar")
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-tar")
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert sorted(members) == sorted([*uploaded, "ledger.json", ATTEMPTS])
    assert {p: d for p, d in members.items() if p in uploaded} == uploaded
    ledger = decode_ledger(members["ledger.json"], "evidence.tar")
    verify_ledger(ledger)
    assert [e.kind for e in ledger] == ["plan", "prepared", "selection"]
    assert json.loads(members["ledger.json"]) == api.get(f"/api/experiments/{experiment_id}/ledger")
    listed = api.get(f"/api/experiments/{experiment_id}/evidence")
    assert [f["path"] for f in listed] == sorted(uploaded)
    assert api.client.get(f"/api/experiments/{experiment_id}/evidence.tar").content == response.content


def test_a_retried_gang_rank_replaces_the_evidence_of_the_lost_generation_and_the_bundle_records_its_cost(
    make_settings: Callable[..., Settings], database_url: str, tmp_path: Path
) -> None:
    with running(make_settings(lease_seconds=1.0, heartbeat_seconds=0.2, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        a, b = api.agent("a"), api.agent("b")
        experiment_id = prepared_experiment(api, a)["id"]
        for agent in (a, b):
            single = agent.claim()
            assert single is not None and single.arm is not None
            agent.finish(single, result=train_result(single.arm))
        rank0, rank1 = a.claim(), b.claim()
        assert rank0 is not None and rank1 is not None
        for agent, job in ((a, rank0), (b, rank1)):
            agent.start(job)
            agent.printed(job, 0, {"event": "started", "resumed_from_step": 0})
        a.printed(rank0, 1, {"event": "step", "step": 1, "seconds": 0.5})
        b.printed(rank1, 1, *({"event": "step", "step": s, "seconds": 0.25} for s in (1, 2, 3)))
        path = "runs/clean-pair/rank-0/run.json"
        a.finish(rank0, result=train_result("clean-pair"), evidence={path: a.upload(b"first\n", rank0)})
        # rank 1 falls silent: the gang is lost and retried; the retry's rank 0 writes the same path anew.
        wait_for(lambda: api.get(f"/api/jobs/{rank0.job_id}")["state"] == "queued", 6, "the gang to be retried")
        retry0, retry1 = a.claim(), b.claim()
        assert retry0 is not None and retry1 is not None and retry0.rank == 0
        evidence = {path: a.upload(b"second\n", retry0)}
        a.finish(retry0, result=train_result("clean-pair"), evidence=evidence)
        b.finish(retry1, result=train_result("clean-pair"))
        listed = api.get(f"/api/experiments/{experiment_id}/evidence")
        assert [(f["path"], f["sha256"]) for f in listed] == [(path, evidence[path])]
        # The bundle's record of the attempts: every train attempt as the API lists it, the steps each was heard
        # to make, and so the lost generation's cost.
        response = api.client.get(f"/api/experiments/{experiment_id}/evidence.tar")
        with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
            tar.extractall(tmp_path, members=[tar.getmember(ATTEMPTS)], filter="data")
        recorded = read_attempts(tmp_path)
        assert recorded is not None
        pair = api.get(f"/api/jobs/{rank0.job_id}/attempts")
        assert [(r.generation, r.rank, r.state) for r in recorded if r.arm == "clean-pair"] == sorted(
            (x["number"], x["rank"], x["state"]) for x in pair
        )
        assert [r.arm for r in recorded].count("clean-pair") == 4 and len(recorded) == 6
        claimed = {x["number"]: datetime.fromisoformat(x["created_at"]) for x in pair if x["rank"] == 0}
        (fault,) = arm_faults(tmp_path / ATTEMPTS, "clean-pair", recorded, [0, 0], FINAL_STEP, require)
        assert (fault.generation, fault.ended, fault.reached_step, fault.resumed_from_step) == (
            1,
            ["succeeded", "lost"],
            3,
            0,
        )
        assert fault.updates_recomputed == 3
        assert fault.seconds_lost == pytest.approx((claimed[2] - claimed[1]).total_seconds(), abs=0.002)
        single = next(r.arm for r in recorded if r.arm != "clean-pair")
        assert arm_faults(tmp_path / ATTEMPTS, single, recorded, [0], FINAL_STEP, require) == []
