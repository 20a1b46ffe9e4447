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

import msgspec

from agent.client import Coordinator
from experiment import wire
from experiment.core.canonical import canonical_bytes, identity, read_json, sha256_bytes, write_new_bytes
from experiment.core.errors import CoopError
from experiment.core.layout import MANIFEST, PREPARED, SELECTION
from experiment.learning.records import Manifest


def as_blobs(files: dict[str, Path]) -> tuple[dict[str, str], dict[str, bytes]]:
    """The files as blobs: path -> sha256 (for the result), and sha256 -> bytes (for the spool to upload)."""
    named: dict[str, str] = {}
    blobs: dict[str, bytes] = {}
    for path, local in files.items():
        data = local.read_bytes()
        named[path] = sha256_bytes(data)
        blobs[named[path]] = data
    return named, blobs


def fetch_prepared(client: Coordinator, experiment_id: uuid.UUID, home: Path, prepared_identity: str) -> None:
    """Download the committed prepared inputs into this host's experiment home (nothing is written unless all
    verify)."""
    files = {path.removeprefix(f"{PREPARED}/"): data for path, data in _download(client, experiment_id, PREPARED)}
    if MANIFEST not in files:
        raise CoopError("the coordinator holds no prepared/manifest.json for this experiment")
    found = identity(json.loads(files[MANIFEST]))
    if found != prepared_identity:
        raise CoopError(
            f"the downloaded manifest's identity {found[:16]} is not the committed prepared identity "
            f"{prepared_identity[:16]}"
        )
    manifest = msgspec.json.decode(files[MANIFEST], type=Manifest)
    for role, entry in manifest.roles.items():
        role_file = files.get(entry.file)
        if role_file is None or sha256_bytes(role_file) != entry.sha256:
            raise CoopError(f"the downloaded prepared {role} file does not match the manifest")
    for name, data in files.items():
        write_new_bytes(home / PREPARED / name, data)


def fetch_folder(client: Coordinator, experiment_id: uuid.UUID, home: Path, folder: str) -> None:
    """Download the evidence files under ``folder`` (another host's evaluation, say) into this host's experiment
    home, each checked against its blob's sha256; a file already there must be identical."""
    files = _download(client, experiment_id, folder)
    if not files:
        raise CoopError(f"the coordinator holds no evidence under {folder}/")
    for path, data in files:
        write_new_bytes(home / path, data)


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


def write_selection(committed: wire.LedgerEntry, home: Path) -> Path:
    """The committed selection document as the home's selection.json (an identical one may already be there)."""
    path = home / SELECTION
    write_new_bytes(path, canonical_bytes(committed.body) + b"\n")
    if identity(read_json(path)) != committed.identity:
        raise CoopError(f"{path} does not carry the committed selection identity {committed.identity[:16]}")
    return path
