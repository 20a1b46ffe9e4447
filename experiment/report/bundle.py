"""The evidence bundle: the small files that let anyone recompute the report (no model weights).

Layout (docs/evidence.md): prepared/, selection.json, evaluations/{dev,test}/ARM/, runs/ARM/rank-R/
(result.json, run.json), seed/ (the seed's tokenizer files), serving/ and ledger.json when present."""

from __future__ import annotations

from pathlib import Path

from experiment.core.canonical import write_new_bytes
from experiment.core.errors import CoopError
from experiment.core.layout import PREPARED, SEED, SELECTION
from experiment.learning.corpus import load_prepared, seed_snapshot
from experiment.seed.seedfiles import verify_seed

OPTIONAL = ("serving", "ledger.json")


def _copy_file(source: Path, target: Path) -> None:
    write_new_bytes(target, source.read_bytes())


def export_bundle(home: Path, model_dir: Path, out: Path) -> list[str]:
    """Copy every evidence file of ``home`` (and the seed's tokenizer files) into ``out``; returns the names."""
    prepared = load_prepared(home)
    verify_seed(model_dir, seed_snapshot(prepared.plan))
    if not (home / SELECTION).is_file():
        raise CoopError(f"{home} has no selection.json; select (and evaluate) before exporting the evidence")
    sources: list[Path] = [p for p in sorted((home / PREPARED).iterdir()) if p.is_file()]
    sources.append(home / SELECTION)
    sources += sorted(p for p in (home / "evaluations").rglob("*") if p.is_file() and not p.name.startswith("."))
    for run in sorted((home / "runs").glob("*/rank-*")):
        sources += [run / name for name in ("result.json", "run.json") if (run / name).is_file()]
    for name in OPTIONAL:
        path = home / name
        sources += (
            sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else ([path] if path.is_file() else [])
        )
    written = []
    for source in sources:
        relative = source.relative_to(home)
        _copy_file(source, out / relative)
        written.append(relative.as_posix())
    for name in sorted(seed_snapshot(prepared.plan).files):
        if not name.endswith(".safetensors"):
            _copy_file(model_dir / name, out / SEED / name)
            written.append(f"{SEED}/{name}")
    return written
