"""What crosses between hosts through the coordinator: evidence files up, prepared inputs and the selection down.

Each job uploads the small files it wrote (docs/evidence.md) as content-addressed blobs and names them in its
result; model weights never leave the host. A host that did not prepare downloads the prepared files, checks
each against its blob's sha256, the manifest against the committed prepared identity and every role file
against the manifest, before any job of it runs. A test evaluation gets the committed selection document.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from agent.client import Coordinator
from agent.jobs import Workspace, benchmark_output
from experiment import layout, wire
from experiment.canonical import canonical_bytes, identity, read_json, sha256_bytes, write_new_bytes
from experiment.errors import CoopError
from experiment.layout import MANIFEST, PREPARED, SEED, SELECTION


def written_by(job: wire.Assignment, ws: Workspace, seed_files: list[str]) -> dict[str, Path]:
    """The bundle paths a succeeded job contributes, each with the local file that holds it."""
    home = ws.home
    if job.kind == "prepare":
        files = {f"{PREPARED}/{p.name}": p for p in sorted((home / PREPARED).iterdir()) if p.is_file()}
        # The seed's small files (tokenizer, template, config) let anyone re-tokenize; the weights stay here.
        files |= {f"{SEED}/{name}": ws.model_dir / name for name in seed_files if not name.endswith(".safetensors")}
        return files
    if job.kind == "train":
        run = home / "runs" / str(job.arm) / f"rank-{job.rank}"
        return {f"runs/{job.arm}/rank-{job.rank}/{name}": run / name for name in ("result.json", "run.json")}
    if job.kind == "benchmark":
        return {f"serving/{job.spec['phase']}.json": benchmark_output(job, ws)}
    if job.kind == "evaluate":
        folder = layout.evaluation(str(job.role), str(job.arm))
        return {f"{folder}/{p.name}": p for p in sorted((home / folder).iterdir()) if p.is_file()}
    return {}


def as_blobs(files: dict[str, Path]) -> tuple[dict[str, str], dict[str, bytes]]:
    """The files as blobs: path -> sha256 (for the result), and sha256 -> bytes (for the spool to upload)."""
    named: dict[str, str] = {}
    blobs: dict[str, bytes] = {}
    for path, local in files.items():
        data = local.read_bytes()
        named[path] = sha256_bytes(data)
        blobs[named[path]] = data
    return named, blobs


def fetch_prepared(client: Coordinator, experiment_id: uuid.UUID, ws: Workspace, prepared_identity: str) -> None:
    """Download the committed prepared inputs into this host's home (nothing is written unless all verify)."""
    files = {path.removeprefix(f"{PREPARED}/"): data for path, data in _download(client, experiment_id, PREPARED)}
    if MANIFEST not in files:
        raise CoopError("the coordinator holds no prepared/manifest.json for this experiment")
    manifest = json.loads(files[MANIFEST])
    if identity(manifest) != prepared_identity:
        raise CoopError(
            f"the downloaded manifest's identity {identity(manifest)[:16]} is not the committed prepared identity "
            f"{prepared_identity[:16]}"
        )
    for role, entry in manifest["roles"].items():
        role_file = files.get(str(entry["file"]))
        if role_file is None or sha256_bytes(role_file) != entry["sha256"]:
            raise CoopError(f"the downloaded prepared {role} file does not match the manifest")
    for name, data in files.items():
        write_new_bytes(ws.home / PREPARED / name, data)


def fetch_folder(client: Coordinator, experiment_id: uuid.UUID, ws: Workspace, folder: str) -> None:
    """Download the evidence files under ``folder`` (another host's evaluation, say) into this host's home, each
    checked against its blob's sha256; a file already there must be identical."""
    files = _download(client, experiment_id, folder)
    if not files:
        raise CoopError(f"the coordinator holds no evidence under {folder}/")
    for path, data in files:
        write_new_bytes(ws.home / path, data)


def _download(client: Coordinator, experiment_id: uuid.UUID, folder: str) -> list[tuple[str, bytes]]:
    """Every evidence file under ``folder`` (bundle path, bytes), each checked against its blob's sha256 before
    any is returned."""
    files = []
    for item in client.evidence(experiment_id):
        if item.path.startswith(f"{folder}/"):
            data = client.download_blob(item.sha256)
            if sha256_bytes(data) != item.sha256:
                raise CoopError(f"the coordinator sent {item.path} with sha256 {sha256_bytes(data)}, not {item.sha256}")
            files.append((item.path, data))
    return files


def write_selection(entries: list[wire.LedgerEntry], ws: Workspace) -> Path:
    """The committed selection document as the home's selection.json (an identical one may already be there)."""
    committed = next((entry for entry in entries if entry.kind == "selection"), None)
    if committed is None:
        raise CoopError("the experiment's ledger has no committed selection; test evaluations wait for it")
    path = ws.home / SELECTION
    write_new_bytes(path, canonical_bytes(committed.body) + b"\n")
    if identity(read_json(path)) != committed.identity:
        raise CoopError(f"{path} does not carry the committed selection identity {committed.identity[:16]}")
    return path
