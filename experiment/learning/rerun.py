"""`coop rerun`: retrain one arm of a published evidence bundle, or its first N updates, on this machine, and say
update by update whether the bundle's journal is reproduced (docs/evidence.md, "Rerunning an arm").

The bundle's prepared inputs are copied into a fresh home and its ranks are trained there by ``coop train``, one
process a rank (gloo on this machine), with the seed the plan names. Every update's loss and gradient norm, on every
rank, must equal the bundle's bit for bit, and after the plan's last update the parameter digest too. The verdict:
- ``identical``: every number equal, on the bundle's numerical profile;
- ``diverged``: the profiles are equal, and a number differs: the first update that does is named, with both
  values. On the same profile the arithmetic is deterministic, so this is a fault;
- ``different-profile``: the profiles differ (the fields are named, e.g. another CPU model, or a bundle older than
  the machine fields). The largest relative difference seen says how far the numbers moved.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import msgspec

from experiment.core import layout
from experiment.core.canonical import write_new_bytes
from experiment.core.errors import CoopError
from experiment.core.ports import free_port
from experiment.core.progress import Emit
from experiment.learning.records import NumericalProfile, Result, StepRecord

Verdict = Literal["identical", "diverged", "different-profile"]


class Difference(msgspec.Struct, frozen=True):
    rank: int
    step: int
    field: str
    bundle: float
    rerun: float


class Rerun(msgspec.Struct, frozen=True):
    """What ``coop rerun`` found, written as JSON."""

    verdict: Verdict
    arm: str
    ranks: int
    updates: int  # the updates rerun
    plan_updates: int
    profile_fields: list[str]  # the numerical profile's fields that differ from the bundle's rank 0
    bundle_profile: NumericalProfile
    rerun_profile: NumericalProfile
    first_difference: Difference | None
    largest_relative_difference: float  # over every rank's losses and gradient norms
    bundle_digest: str | None  # the final parameter digests, once every update was rerun
    rerun_digest: str | None


def _results(bundle: Path, arm: str) -> list[Result]:
    runs = sorted((bundle / layout.arm_runs(arm)).glob("rank-*/result.json"))
    if not runs:
        raise CoopError(f"{bundle} holds no run of arm {arm} (runs/{arm}/rank-R/result.json)")
    try:
        results = [msgspec.json.decode(path.read_bytes(), type=Result) for path in runs]
    except msgspec.DecodeError as exc:
        raise CoopError(f"a result of arm {arm} in {bundle} is malformed: {exc}") from exc
    ranks = sorted(result.rank for result in results)
    if ranks != list(range(results[0].world_size)):
        raise CoopError(f"{bundle} holds ranks {ranks} of arm {arm}, which trained on {results[0].world_size}")
    return sorted(results, key=lambda result: result.rank)


def _events(stream: IO[str]) -> Iterator[dict[str, object]]:
    for line in stream:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def _relative(bundle: float, rerun: float) -> float:
    if bundle == rerun:
        return 0.0
    return abs(rerun - bundle) / max(abs(bundle), 1e-300)


@dataclass
class _Compared:
    """What the rerun's ranks printed, against the bundle's journals, as it is read."""

    journals: dict[int, dict[int, StepRecord]]
    profile: NumericalProfile = field(default_factory=dict)
    first: Difference | None = None
    largest: float = 0.0
    digest: str | None = None

    def take(self, rank: int, event: dict[str, object]) -> int | None:
        """One event of ``rank``'s; the update it compared, if it was a step."""
        kind = event.get("event")
        if kind == "started" and rank == 0:
            self.profile = msgspec.convert(event.get("numerical_profile", {}), type=NumericalProfile)
        if kind == "completed" and rank == 0:
            self.digest = str(event["parameter_digest"])
        if kind != "step":
            return None
        step = int(str(event["done"]))
        recorded = self.journals[rank].get(step)
        if recorded is None:
            raise CoopError(f"the bundle's rank {rank} has no journal entry for update {step}")
        for name, found in (("loss", recorded.loss), ("gradient_norm", recorded.gradient_norm)):
            value = float(str(event[name]))
            self.largest = max(self.largest, _relative(found, value))
            if value != found and (self.first is None or (step, rank) < (self.first.step, self.first.rank)):
                self.first = Difference(rank=rank, step=step, field=name, bundle=found, rerun=value)
        return step


def _train_ranks(
    argv: list[str], world: int, work: Path, compared: _Compared, progress: Callable[[int, float], None]
) -> None:
    """Run ``argv`` as each rank of ``world`` here (gloo on loopback), comparing what each prints. Rank 0's events
    are followed as they come (progress); the others' go to a file each, read once they ended."""
    port = free_port()
    logs = [(work / f"rank-{rank}.log").open("w") for rank in range(world)]
    printed = [(work / f"rank-{rank}.events").open("w+") for rank in range(1, world)]
    processes = []
    try:
        for rank in range(world):
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "RANK": str(rank), "WORLD_SIZE": str(world)}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
            out: int | IO[str] = subprocess.PIPE if rank == 0 else printed[rank - 1]
            processes.append(subprocess.Popen(argv, env=env, stdout=out, stderr=logs[rank], text=True, cwd=work))
        for rank, process in enumerate(processes):
            if rank > 0:
                process.wait()
                printed[rank - 1].seek(0)
            stream = processes[0].stdout if rank == 0 else printed[rank - 1]
            assert stream is not None
            for event in _events(stream):
                step = compared.take(rank, event)
                if step is not None and rank == 0:
                    progress(step, float(str(event["loss"])))
            if process.wait() != 0:
                tail = (work / f"rank-{rank}.log").read_text(errors="replace")[-2000:]
                raise CoopError(f"rank {rank} of the rerun exited {process.returncode}: {tail}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in [*logs, *printed]:
            log.close()


def rerun(bundle: Path, model_dir: Path, arm: str, updates: int | None, work: Path, emit: Emit) -> Rerun:
    """Retrain ``arm``'s first ``updates`` updates (all of them by default) in ``work`` and compare."""
    results = _results(bundle, arm)
    home = work / "home"
    if home.exists():
        raise CoopError(f"{home} exists; rerun into an empty folder")
    shutil.copytree(bundle / layout.PREPARED, home / layout.PREPARED)
    from experiment.learning.corpus import load_prepared  # after the copy: it reads the home

    total = load_prepared(home).plan.training.updates
    count = total if updates is None else updates
    if not 1 <= count <= total:
        raise CoopError(f"--updates must be between 1 and the plan's {total}")
    argv = [sys.executable, "-m", "experiment.cli", "train", "--home", str(home), "--model-dir", str(model_dir)]
    argv += ["--arm", arm, *(["--stop-after", str(count)] if count < total else [])]
    compared = _Compared({result.rank: {entry.step: entry for entry in result.journal} for result in results})

    def progress(step: int, loss: float) -> None:
        emit({"event": "rerun-step", "done": step, "total": count, "loss": loss, "equal": compared.first is None})

    _train_ranks(argv, results[0].world_size, work, compared, progress)
    bundle_profile = results[0].numerical_profile
    fields = sorted(
        name
        for name in bundle_profile.keys() | compared.profile.keys()
        if bundle_profile.get(name) != compared.profile.get(name)
    )
    bundle_digest = results[0].parameter_digest if count == total else None
    rerun_digest = compared.digest if count == total else None
    same = compared.first is None and bundle_digest == rerun_digest
    verdict: Verdict = "different-profile" if fields else ("identical" if same else "diverged")
    return Rerun(
        verdict=verdict,
        arm=arm,
        ranks=results[0].world_size,
        updates=count,
        plan_updates=total,
        profile_fields=fields,
        bundle_profile=bundle_profile,
        rerun_profile=compared.profile,
        first_difference=compared.first,
        largest_relative_difference=compared.largest,
        bundle_digest=bundle_digest,
        rerun_digest=rerun_digest,
    )


def words(found: Rerun) -> str:
    """The verdict as a sentence."""
    if found.verdict == "identical":
        return f"identical: {found.updates} updates of {found.arm} on {found.ranks} rank(s), every number bit for bit"
    moved = f"the largest relative difference seen is {found.largest_relative_difference:.3g}"
    if found.verdict == "different-profile":
        return f"different profile ({', '.join(found.profile_fields)}); {moved}"
    first = found.first_difference
    if first is None:
        return (
            f"diverged at the final digest: {found.rerun_digest} against the bundle's {found.bundle_digest}, every "
            f"update's numbers equal, on the same profile (a fault)"
        )
    return (
        f"diverged at update {first.step}: rank {first.rank}'s {first.field} is {first.rerun!r}, the bundle's "
        f"{first.bundle!r}, on the same profile (a fault); {moved}"
    )


def write(found: Rerun, out: Path) -> None:
    write_new_bytes(out, msgspec.json.format(msgspec.json.encode(found), indent=2) + b"\n")
