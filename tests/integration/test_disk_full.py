"""A full disk is refused, never half-written, on a small tmpfs (as root, as CI and `make test` are): a host whose
disk fills before a checkpoint ends the run naming the folder and the bytes needed, keeps no part of it, and
resumes from its last whole checkpoint to the parameters of a run that never ran short once space is freed; a
coordinator whose blob store fills answers uploads 507, keeps nothing of them, and the agent's spool sends them
again until space is freed and the job succeeds."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from experiment.core.plan import load_plan
from experiment.learning import corpus
from experiment.seed import seedmodel
from tests.conftest import write_plan
from tests.integration.agent.support import AgentProcess
from tests.support.processes import QUICK, CoordinatorProcess, coop_train
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI and `make test` are)")

Seed = tuple[Path, seedmodel.Snapshot]


@contextlib.contextmanager
def tmpfs(folder: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``folder`` (made if missing) until the block exits."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def resize(folder: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


def free_bytes(folder: Path) -> int:
    """The disk's free bytes as df counts them (a second reading beside the code's own shutil.disk_usage)."""
    out = subprocess.run(["df", "--block-size=1", "--output=avail", str(folder)], check=True, capture_output=True)
    return int(out.stdout.split()[-1])


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prepared_home(folder: Path, seed: Seed) -> Path:
    folder.mkdir()
    plan = write_plan(folder / "plan.toml", seed[1])
    corpus.prepare(load_plan(plan), plan, folder / "home", seed[0], None, lambda event: None)
    return folder / "home"


def test_a_host_whose_disk_fills_before_a_checkpoint_stops_unfinished_and_resumes_once_space_is_freed(
    small_seed: Seed, tmp_path: Path
) -> None:
    # The truth: the same arm trained where space never ran short.
    reference = prepared_home(tmp_path / "reference", small_seed)
    (ran,) = coop_train(reference, small_seed[0], "clean-single", 1)
    assert ran.returncode == 0, ran.stderr[-2000:]
    run_dir = reference / "runs" / "clean-single" / "rank-0"
    truth = json.loads((run_dir / "result.json").read_text())["parameter_digest"]
    first, last = sorted((run_dir / "checkpoints").iterdir())  # steps 2 and 4 of the small plan
    checkpoint = folder_bytes(first)

    home = prepared_home(tmp_path / "short", small_seed)
    # Room for the first checkpoint (with the 1 MiB the check adds) and a half: the second does not fit.
    with tmpfs(home / "runs", int(checkpoint * 1.5) + (1 << 20)) as runs:
        (short,) = coop_train(home, small_seed[0], "clean-single", 1)
        assert short.returncode != 0
        folder = runs / "clean-single" / "rank-0" / "checkpoints"
        said = r"no space for the checkpoint of step (\d+) in (\S+): it needs about (\d+) bytes"
        message = re.search(said, short.stderr)
        assert message is not None, short.stderr[-2000:]
        assert (int(message[1]), message[2]) == (4, str(folder))
        assert int(message[3]) >= folder_bytes(last)  # what it asked for covers what the step's checkpoint takes
        assert sorted(p.name for p in folder.iterdir()) == [first.name]  # no partial folder of step 4
        assert not (runs / "clean-single" / "rank-0" / "result.json").exists()  # never counted as finished

        resize(runs, 4 * checkpoint + (4 << 20))
        (resumed,) = coop_train(home, small_seed[0], "clean-single", 1)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        result = json.loads((runs / "clean-single" / "rank-0" / "result.json").read_text())
        assert result["resumed_from_step"] == 2
        assert result["parameter_digest"] == truth


def _metric(server: CoordinatorProcess, name: str, **labels: str) -> float | None:
    """One sample of the coordinator's scrape (Prometheus' own parser reads it)."""
    response = server.http.get("/metrics", headers={"Authorization": f"Bearer {server.operator}"})
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def _attempt(server: CoordinatorProcess, job_id: str) -> dict[str, Any] | None:
    attempts: list[dict[str, Any]] = server.get(f"/api/jobs/{job_id}/attempts")
    return attempts[-1] if attempts else None


def test_a_full_blob_store_answers_507_keeps_nothing_and_the_agent_sends_again_once_space_is_freed(
    tmp_path: Path, small_seed: Seed, small_plan: Path
) -> None:
    home = tmp_path / "coordinator"
    with tmpfs(home / "blobs", 32 << 20) as store:
        filler = store / "filler"
        subprocess.run(["fallocate", "-l", str(free_bytes(store) - (64 << 10)), str(filler)], check=True)
        server = CoordinatorProcess(home, **QUICK)
        server.start()
        agent = AgentProcess(server, "host-a", tmp_path / "host-a", small_seed[0], server.agent_token("host-a"))
        try:
            experiment = server.create_experiment(small_plan)
            (job,) = [j for j in server.jobs(experiment["id"]) if j["kind"] == "prepare"]
            agent.start()
            # The agent's client retries a 5xx a few times before it defers the upload to the spool's next round.
            wait_for(lambda: "HTTP 507" in agent.log(), 90, "the agent to defer an upload the coordinator refused")
            assert "is full" in agent.log()
            refused = {"upload": "blob", "reason": "insufficient-storage"}
            assert (_metric(server, "coop_uploads_refused_total", **refused) or 0) >= 2
            # Nothing of a refused upload stays, and the attempt still runs: its agent holds it and sends again.
            assert list((store / ".incoming").iterdir()) == []
            deferred = re.search(r"blob-([0-9a-f]{64}) deferred", agent.log())
            assert deferred is not None
            assert server.http.get(f"/api/blobs/{deferred[1]}").status_code == 404  # no row, no file
            attempt = _attempt(server, job["id"])
            assert attempt is not None and attempt["state"] in {"leased", "running"}, attempt

            filler.unlink()
            done = wait_for(
                lambda: (j := server.get(f"/api/jobs/{job['id']}"))["state"] in {"succeeded", "failed"} and j,
                90,
                "the prepare job to finish",
            )
            assert done["state"] == "succeeded", agent.log()[-3000:]
            attempts: list[dict[str, Any]] = server.get(f"/api/jobs/{job['id']}/attempts")
            assert [a["state"] for a in attempts] == ["succeeded"]  # the first attempt, never lost or failed
            # Every evidence file is the agent's own prepared file, byte for byte.
            prepared = tmp_path / "host-a" / "experiments" / experiment["id"] / "home"
            evidence = server.get(f"/api/experiments/{experiment['id']}/evidence")
            assert any(f["path"] == "prepared/manifest.json" for f in evidence)
            for entry in evidence:
                local = prepared / entry["path"]
                if local.is_file():
                    assert hashlib.sha256(local.read_bytes()).hexdigest() == entry["sha256"], entry["path"]
                    stored = store / entry["sha256"][:2] / entry["sha256"]
                    assert hashlib.sha256(stored.read_bytes()).hexdigest() == entry["sha256"]
            # The scrape's free space is the disk's, as df reads it.
            assert _metric(server, "coop_blob_store_free_bytes") == pytest.approx(free_bytes(store), abs=1 << 16)
        finally:
            agent.stop()
            server.close()
            shutil.rmtree(home / "blobs" / ".incoming", ignore_errors=True)
