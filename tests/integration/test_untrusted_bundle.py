"""An evidence bundle from elsewhere is read without leaving it: `coop report` refuses a bundle that holds a symbolic
link, or whose files name another file by an absolute path or one that climbs out with '..', names the member and
exits 2; the real bundle still reports.

The bundle is the real one of tests/data (its served answers replaced by the evaluated ones, so that it reports)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import msgspec
import pytest

from experiment import cli
from experiment.core.canonical import canonical_bytes, sha256_file
from experiment.core.errors import CoopError
from experiment.core.members import member
from experiment.core.plan import Plan, plan_identity
from tests.integration.test_report_serving import BROKEN, _served_as_evaluated


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("untrusted")
    with tarfile.open(BROKEN) as tar:
        tar.extractall(folder / "extracted", filter="data")
    return _served_as_evaluated(folder / "extracted", folder / "evidence")


@pytest.fixture
def bundle(evidence: Path, tmp_path: Path) -> Path:
    """A copy of the good bundle, to spoil."""
    return Path(shutil.copytree(evidence, tmp_path / "bundle"))


def _report(bundle: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`coop report` on the bundle: its exit status and what it printed on stderr."""
    output = bundle.parent / "report.json"
    status = cli.main(["report", "--home", str(bundle), "--output", str(output)])
    assert status == 0 or not output.exists()  # a refused bundle leaves no report
    return status, capsys.readouterr().err


def _rewrite_json(path: Path, change: dict[str, object]) -> None:
    path.write_bytes(canonical_bytes(json.loads(path.read_bytes()) | change) + b"\n")


def _name_role_file(bundle: Path, name: str) -> None:
    """The manifest names the dev role file ``name`` (nothing else checks the manifest before the file is read)."""
    path = bundle / "prepared" / "manifest.json"
    roles = json.loads(path.read_bytes())["roles"]
    _rewrite_json(path, {"roles": roles | {"dev": roles["dev"] | {"file": name}}})


def test_the_real_bundle_is_reported(evidence: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["report", "--home", str(evidence), "--output", str(tmp_path / "report.json")])
    assert status == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_bytes())["serving"] is not None


def test_a_file_linked_outside_is_refused_and_named(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outside = bundle.parent / "single.json"
    (bundle / "serving" / "single.json").rename(outside)
    (bundle / "serving" / "single.json").symlink_to(outside)
    assert _report(bundle, capsys) == (
        2,
        f"coop: {bundle}: serving/single.json: is a symbolic link (to {outside}); a bundle holds only plain files\n",
    )


def test_a_file_linked_inside_is_refused_and_named(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (bundle / "selection.json").rename(bundle / "selection-kept.json")
    (bundle / "selection.json").symlink_to("selection-kept.json")
    status, printed = _report(bundle, capsys)
    assert status == 2
    assert f"{bundle}: selection.json: is a symbolic link (to selection-kept.json)" in printed


def test_a_linked_folder_is_refused_and_named(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = bundle / "evaluations" / "test" / "seed"
    folder.rename(bundle.parent / "seed-evaluation")
    folder.symlink_to(bundle.parent / "seed-evaluation", target_is_directory=True)
    status, printed = _report(bundle, capsys)
    assert status == 2
    assert f"{bundle}: evaluations/test/seed: is a symbolic link" in printed


def test_a_role_file_named_by_climbing_out_is_refused(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(bundle / "prepared" / "dev.jsonl", bundle / "outside.json")  # the same bytes: only the name is wrong
    _name_role_file(bundle, "../outside.json")
    assert _report(bundle, capsys) == (
        2,
        f"coop: {bundle}: prepared/../outside.json: climbs out of its folder with '..' "
        "(named by prepared/manifest.json roles.dev.file); a bundle names only its own files\n",
    )


def test_a_role_file_named_by_an_absolute_path_is_refused(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _name_role_file(bundle, "/etc/passwd")
    status, printed = _report(bundle, capsys)
    assert status == 2
    assert f"coop: {bundle}: /etc/passwd: is an absolute path (named by prepared/manifest.json roles.dev.file)" in (
        printed
    )


def test_a_tokenizer_file_named_outside_the_seed_is_refused(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers opens the fast tokenizer file that tokenizer_config.json names, relative to the folder: a bundle
    consistent with itself (its plan records the changed config's hash) still may not name one outside."""
    (bundle.parent / "outside").mkdir()
    shutil.copy(bundle / "seed" / "tokenizer.json", bundle.parent / "outside" / "tokenizer.1.0.json")
    config = bundle / "seed" / "tokenizer_config.json"
    _rewrite_json(config, {"fast_tokenizer_files": ["../../outside/tokenizer.1.0.json"]})
    plan_path = bundle / "prepared" / "plan.json"
    plan = json.loads(plan_path.read_bytes())
    plan["seed"]["files"]["tokenizer_config.json"] = sha256_file(config)
    _rewrite_json(plan_path, plan)
    _rewrite_json(
        bundle / "prepared" / "manifest.json", {"plan_identity": plan_identity(msgspec.convert(plan, type=Plan))}
    )
    status, printed = _report(bundle, capsys)
    assert status == 2
    assert (
        f"coop: {bundle}: seed/../../outside/tokenizer.1.0.json: climbs out of its folder with '..' "
        "(named by seed/tokenizer_config.json fast_tokenizer_files)"
    ) in printed


def test_a_name_that_resolves_outside_its_folder_is_refused(tmp_path: Path) -> None:
    """A home a command made itself is not searched for links (coop train reads its own); a name that reaches out
    through one is still refused."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "home" / "prepared").mkdir(parents=True)
    (tmp_path / "home" / "prepared" / "inner").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert member(tmp_path / "home", "prepared", "dev.jsonl", "a test") == tmp_path / "home" / "prepared" / "dev.jsonl"
    with pytest.raises(CoopError, match=r"home: prepared/inner/dev\.jsonl: resolves outside prepared/ \(named by a"):
        member(tmp_path / "home", "prepared", "inner/dev.jsonl", "a test")


def test_the_coop_command_names_the_link_and_exits_2(bundle: Path) -> None:
    os.symlink("/etc/passwd", bundle / "runs" / "clean-pair" / "rank-0" / "notes.txt")
    done = subprocess.run(
        [sys.executable, "-m", "experiment.cli", "report", "--home", str(bundle), "--output", str(bundle.parent / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"coop: {bundle}: runs/clean-pair/rank-0/notes.txt: is a symbolic link (to /etc/passwd); "
        "a bundle holds only plain files\n"
    )
