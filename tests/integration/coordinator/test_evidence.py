"""Blobs are stored by content (verified, idempotent, bounded) and the evidence bundle is exported as a tar
of the blobs each job named, plus the commitment ledger."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiment.canonical import canonical_bytes, sha256_bytes
from experiment.ledger import decode_ledger, verify_ledger
from server.settings import Settings
from tests.integration.coordinator.support import (
    Api,
    bearer,
    prepared_experiment,
    running,
    select_and_advance,
    sha,
    train_result,
)


def _put(api: Api, token: str, data: bytes, name: str | None = None, job: dict[str, Any] | None = None) -> Any:
    """An upload as the operator, or as an agent naming the attempt ``job`` whose evidence it is."""
    digest = name or hashlib.sha256(data).hexdigest()
    query = f"?attempt={job['attempt_id']}" if job is not None else ""
    return api.client.put(
        f"/api/blobs/{digest}{query}", content=data, headers={**bearer(token), "Content-Type": "text/html"}
    )


def test_blob_upload_is_verified_idempotent_and_downloadable(api: Api, tmp_path: Path) -> None:
    a = api.agent("a")
    api.create_experiment()
    job = api.claim(a)
    assert job is not None
    data = b'<script>alert("a blob")</script>\n'
    digest = hashlib.sha256(data).hexdigest()
    first = _put(api, a, data, job=job)
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
    mismatch = _put(api, a, b"other bytes", name=digest, job=job)
    assert mismatch.status_code == 400 and "sha256" in mismatch.json()["detail"]
    assert stored.read_bytes() == data  # never overwritten
    assert _put(api, a, data, name="not-a-digest", job=job).status_code == 400
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

    def upload(token: str, files: dict[str, bytes], job: dict[str, Any] | None = None) -> dict[str, str]:
        named = {}
        for path, data in files.items():
            assert _put(api, token, data, job=job).status_code in {200, 201}
            named[path] = hashlib.sha256(data).hexdigest()
        uploaded.update(files)
        return named

    experiment = api.create_experiment()
    experiment_id = experiment["id"]
    prepare = api.claim(a)
    assert prepare is not None
    prepared = upload(
        a,
        _files("prepared/", ("plan.json", "manifest.json", "test.jsonl")) | _files("seed/", ("tokenizer.json",)),
        prepare,
    )
    reply = api.report(a, prepare, result={"prepared_identity": sha("prepared")}, evidence=prepared)
    assert reply.status_code == 200, reply.text
    for token in (a, b):
        job = api.claim(token)
        assert job is not None and job["kind"] == "train"
        outside = api.report(
            token, job, result=train_result(job["arm"]), evidence=upload(token, _files("prepared/", ("x",)), job)
        )
        assert outside.status_code == 409 and outside.json()["rule"] == "evidence-outside-job"
        uploaded.pop("prepared/x")
        runs = upload(token, _files(f"runs/{job['arm']}/rank-0/", ("result.json", "run.json")), job)
        assert api.report(token, job, result=train_result(job["arm"]), evidence=runs).status_code == 200
    ranks = [api.claim(a), api.claim(b)]
    assert api.operator_post(f"/api/experiments/{experiment_id}/autopilot", {"on": False}).status_code == 200
    for token, job in zip((a, b), ranks, strict=True):
        assert job is not None
        runs = upload(token, _files(f"runs/clean-pair/rank-{job['rank']}/", ("result.json", "run.json")), job)
        assert api.report(token, job, result=train_result("clean-pair"), evidence=runs).status_code == 200
    select_and_advance(api, experiment_id)
    # The committed selection is the bundle's selection.json, written by the coordinator; it is never replaced.
    committed = next(e for e in api.get(f"/api/experiments/{experiment_id}/ledger") if e["kind"] == "selection")
    assert sha256_bytes(canonical_bytes(committed["body"])) == committed["identity"]
    conflict = api.operator_post(
        f"/api/experiments/{experiment_id}/evidence", {"files": upload(api.operator, {"selection.json": b"{}\n"})}
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
    assert sorted(members) == sorted([*uploaded, "ledger.json"])
    assert {p: d for p, d in members.items() if p in uploaded} == uploaded
    ledger = decode_ledger(members["ledger.json"], "evidence.tar")
    verify_ledger(ledger)
    assert [e.kind for e in ledger] == ["plan", "prepared", "selection"]
    assert json.loads(members["ledger.json"]) == api.get(f"/api/experiments/{experiment_id}/ledger")
    listed = api.get(f"/api/experiments/{experiment_id}/evidence")
    assert [f["path"] for f in listed] == sorted(uploaded)
    assert api.client.get(f"/api/experiments/{experiment_id}/evidence.tar").content == response.content


def test_a_retried_gang_rank_replaces_the_evidence_of_the_lost_generation(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings(lease_seconds=1.0, heartbeat_seconds=0.2, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        a, b = api.agent("a"), api.agent("b")
        experiment_id = prepared_experiment(api, a)["id"]
        for token in (a, b):
            single = api.claim(token)
            assert single is not None
            assert api.finish(token, single, **train_result(single["arm"])).status_code == 200
        rank0, rank1 = api.claim(a), api.claim(b)
        assert rank0 is not None and rank1 is not None
        first = {"runs/clean-pair/rank-0/run.json": b"first\n"}
        named = {p: hashlib.sha256(d).hexdigest() for p, d in first.items()}
        for data in first.values():
            assert _put(api, a, data, job=rank0).status_code == 201
        assert api.report(a, rank0, result=train_result("clean-pair"), evidence=named).status_code == 200
        # rank 1 falls silent: the gang is lost and retried; the retry's rank 0 writes the same path anew.
        import time

        deadline = time.monotonic() + 6
        while api.get(f"/api/jobs/{rank0['job_id']}")["state"] != "queued":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        retry0, retry1 = api.claim(a), api.claim(b)
        assert retry0 is not None and retry1 is not None and retry0["rank"] == 0
        second = b"second\n"
        assert _put(api, a, second, job=retry0).status_code == 201
        path = "runs/clean-pair/rank-0/run.json"
        evidence = {path: hashlib.sha256(second).hexdigest()}
        assert api.report(a, retry0, result=train_result("clean-pair"), evidence=evidence).status_code == 200
        assert api.finish(b, retry1, **train_result("clean-pair")).status_code == 200
        listed = api.get(f"/api/experiments/{experiment_id}/evidence")
        assert [(f["path"], f["sha256"]) for f in listed] == [(path, evidence[path])]
