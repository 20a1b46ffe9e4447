"""Selection: each arm's final-step checkpoint, verified, never chosen by a score.

The selection names, per arm, the model that test evaluation and serving may use; it is committed
before any test evaluation starts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from experiment.core import layout
from experiment.core.canonical import identity, read_json, write_new_json
from experiment.core.errors import CoopError
from experiment.core.layout import SELECTION
from experiment.core.plan import seed_identity
from experiment.learning import receipts
from experiment.learning.corpus import Prepared
from experiment.learning.records import Candidate, Pointer
from experiment.seed.seedfiles import tensor_layout


def same_model(a: Candidate, b: Candidate) -> bool:
    """The same arm, step, binding and final parameters (paths and receipts differ between ranks' hosts)."""
    return (a.arm, a.model_identity, a.step, a.binding) == (b.arm, b.model_identity, b.step, b.binding)


class Selection(msgspec.Struct, frozen=True):
    prepared_identity: str
    plan_identity: str
    arms: dict[str, Candidate]


def _result(run: Path) -> dict[str, object]:
    path = run / "result.json"
    if not path.is_file():
        raise CoopError(f"{run} has no finished run (no result.json); train the arm before selecting")
    result: dict[str, object] = read_json(path)
    return result


def candidate_for(prepared: Prepared, arm: str, seed_dir: Path) -> Candidate:
    """The arm's final checkpoint as this host holds it, verified on every rank folder present here: its files,
    and its weights in the tensor layout of the seed in ``seed_dir``."""
    plan = prepared.plan
    if not plan.arm_plan(arm).trained:
        return Candidate(arm=arm, model_identity=seed_identity(plan))
    final = plan.training.updates
    tensors = tensor_layout(seed_dir)
    runs = sorted((prepared.home / layout.arm_runs(arm)).glob("rank-*"))
    if not runs:
        raise CoopError(f"arm {arm} has no run under {prepared.home / layout.arm_runs(arm)}")
    chosen: Candidate | None = None
    for run in runs:
        result = _result(run)
        pointer = msgspec.convert(result["candidate"], type=Pointer)
        if pointer.step != final:
            raise CoopError(f"{run}: the candidate is step {pointer.step}; only the final step {final} is eligible")
        binding = str(result["binding"])
        receipt = receipts.verify(run, pointer, binding, tensors)
        if receipt.parameter_digest != result["parameter_digest"]:
            raise CoopError(f"{run}: the final checkpoint's digest differs from the run's result")
        if result["prepared_identity"] != prepared.identity:
            raise CoopError(f"{run} was trained on other prepared inputs")
        candidate = Candidate(
            arm=arm,
            model_identity=receipt.parameter_digest,
            path=receipts.model_dir(run, pointer).relative_to(prepared.home).as_posix(),
            step=pointer.step,
            binding=binding,
            receipt_sha256=pointer.receipt_sha256,
        )
        if chosen is None:
            chosen = candidate
        elif chosen.model_identity != candidate.model_identity:
            raise CoopError(f"the ranks of {arm} disagree on the final parameter digest")
    assert chosen is not None
    return chosen


def select(prepared: Prepared, seed_dir: Path) -> tuple[Selection, Path]:
    """Every arm's final candidate, each verified; written once (an identical re-run is accepted)."""
    arms = {arm: candidate_for(prepared, arm, seed_dir) for arm in prepared.plan.arm_names()}
    selection = Selection(prepared_identity=prepared.identity, plan_identity=prepared.manifest.plan_identity, arms=arms)
    path = prepared.home / SELECTION
    write_new_json(path, msgspec.to_builtins(selection))
    return selection, path


def read_selection(path: Path) -> Selection:
    try:
        return msgspec.convert(read_json(path), type=Selection)
    except msgspec.ValidationError as exc:
        raise CoopError(f"selection {path} is malformed: {exc}") from exc


def selection_identity(selection: Selection) -> str:
    return identity(msgspec.to_builtins(selection))
