"""A verifier's install (docs/evidence.md): the project's wheel with the base dependencies alone, from their lock
(requirements/verify.txt, pip --require-hashes), in a fresh venv. It recomputes the committed SmolLM2 report from
the committed evidence bundle byte for byte, holds nothing of the server or host extras, and a package the report
needs, once removed, is one line naming the install command and exit 2.

Outside CI, pip takes the locked files where the machine's pip configuration points it (a wheel folder); the hashes
decide which files are accepted. The tests share one venv and run in file order: the last removes a package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.support import ROOT

pytestmark = pytest.mark.slow

RUN = ROOT / "bench" / "results" / "smollm2-135m"
LOCK = ROOT / "requirements" / "verify.txt"
# What the server and host extras bring, and `coop report` does without: the ML stack, the HTTP client and the
# process sampler (each once failed `coop report` in a venv of the report's packages), the web framework and database.
NOT_FOR_A_VERIFIER = ("torch", "transformers", "safetensors", "accelerate", "httpx", "psutil", "litestar", "sqlalchemy")
# The project's wheel, and the setuptools that Python 3.11's venv installs beside pip.
BESIDE_THE_LOCK = {"coop", "setuptools"}


@dataclass(frozen=True)
class Verifier:
    venv: Path
    bundle: Path

    def run(self, *argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A command of the venv (``bin/NAME``), run outside the repository, without this process's PYTHONPATH."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env |= {"HF_HUB_OFFLINE": "1", "PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
        command = [str(self.venv / "bin" / str(argv[0])), *(str(a) for a in argv[1:])]
        return subprocess.run(
            command, cwd=self.venv.parent, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def installed(self) -> set[str]:
        listing = "import importlib.metadata as m, json; print(json.dumps([d.name for d in m.distributions()]))"
        done = _checked(self.run("python", "-c", listing))
        return {canonicalize_name(name) for name in json.loads(done.stdout)}


def _checked(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, f"{done.args}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Verifier]:
    """docs/evidence.md's commands: a fresh venv, the verify lock, then the project's wheel built by the lock's
    hatchling without fetching anything, installed without dependencies. pip compiles nothing ahead (--no-compile):
    the report compiles the few modules it imports, a fraction of scipy's and matplotlib's."""
    folder = tmp_path_factory.mktemp("verifier")
    _checked(subprocess.run([sys.executable, "-m", "venv", folder / "venv"], capture_output=True, text=True))
    verifier = Verifier(folder / "venv", folder / "evidence")
    install = ("python", "-m", "pip", "install", "--quiet", "--no-compile")
    _checked(verifier.run(*install, "--require-hashes", "-r", LOCK))
    wheels = folder / "dist"
    build = ("python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", wheels)
    _checked(verifier.run(*build, ROOT))
    [wheel] = wheels.glob("coop-*.whl")
    _checked(verifier.run(*install, "--no-deps", wheel))
    with tarfile.open(RUN / "evidence.tar.gz") as tar:
        tar.extractall(verifier.bundle, filter="data")
    yield verifier
    shutil.rmtree(folder)  # about 400 MB, not kept until pytest's own clean-up


def test_the_venv_holds_the_verify_lock_and_nothing_of_the_server_or_host(verifier: Verifier) -> None:
    locked = {canonicalize_name(m[1]) for m in re.finditer(r"(?m)^([A-Za-z0-9][A-Za-z0-9._-]*)==", LOCK.read_text())}
    installed = verifier.installed()
    assert "coop" in installed
    assert locked <= installed
    assert installed - locked <= BESIDE_THE_LOCK
    assert not installed & set(NOT_FOR_A_VERIFIER)


def test_the_base_install_recomputes_the_committed_report_byte_for_byte(verifier: Verifier) -> None:
    output = verifier.venv.parent / "out" / "report.json"
    done = verifier.run("coop", "report", "--home", verifier.bundle, "--output", output)
    assert done.returncode == 0, done.stderr
    assert output.read_bytes() == (RUN / "report.json").read_bytes()


def test_a_missing_package_is_one_line_naming_the_install_command_and_exit_2(verifier: Verifier) -> None:
    """Last: it removes scipy from the shared venv."""
    _checked(verifier.run("python", "-m", "pip", "uninstall", "--quiet", "--yes", "scipy"))
    output = verifier.venv.parent / "without-scipy" / "report.json"
    done = verifier.run("coop", "report", "--home", verifier.bundle, "--output", output)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "scipy" in line and "pip install" in line, line
    assert not output.exists()
