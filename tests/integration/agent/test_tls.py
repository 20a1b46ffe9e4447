"""Agents and a coordinator over TLS, all real processes: an agent given the CA file registers, claims and reports over
HTTPS; one whose coordinator does not verify (another CA, another host name) exits 2 and the coordinator never hears
its token; plain http is refused to any host but loopback; the token comes from a file or the environment, never
from argv."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.seed import seedmodel
from server import models
from tests.integration.agent.support import AgentProcess
from tests.support import ROOT
from tests.support.database import with_session
from tests.support.processes import QUICK, CoordinatorProcess
from tests.support.tls import Authority, ServerFiles
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> ServerFiles:
    return Authority("coop test CA").issue(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_coordinator(tmp_path: Path, certificate: ServerFiles) -> Iterator[CoordinatorProcess]:
    home = tmp_path / "coordinator"
    home.mkdir()
    server = CoordinatorProcess(home, certificate=certificate, **QUICK)
    server.start()
    try:
        yield server
    finally:
        server.close()


def _agents(server: CoordinatorProcess) -> dict[str, dict[str, Any]]:
    return {agent["name"]: agent for agent in server.get("/api/agents")}


def _what_the_token_did(server: CoordinatorProcess, name: str) -> tuple[list[str], list[str]]:
    """The coordinator's own records of the agent token ``name``: its agent rows and its audit rows' actions."""

    async def read(session: AsyncSession) -> tuple[list[str], list[str]]:
        token_id = await session.scalar(select(models.Token.id).where(models.Token.name == name))
        assert isinstance(token_id, uuid.UUID)
        agents = await session.scalars(select(models.Agent.name).where(models.Agent.token_id == token_id))
        actions = await session.scalars(select(models.AuditLog.action).where(models.AuditLog.token_id == token_id))
        return list(agents), list(actions)

    return with_session(server.database_url, read)


def test_an_agent_given_the_ca_file_registers_claims_and_reports_over_https(
    tls_coordinator: CoordinatorProcess,
    certificate: ServerFiles,
    small_seed: tuple[Path, seedmodel.Snapshot],
    small_plan: Path,
    tmp_path: Path,
) -> None:
    experiment = tls_coordinator.create_experiment(small_plan)
    (job,) = [j for j in tls_coordinator.jobs(experiment["id"]) if j["kind"] == "prepare"]
    token = tls_coordinator.agent_token("host-a")
    ca = ("--ca-file", str(certificate.ca_file))
    agent = AgentProcess(tls_coordinator, "host-a", tmp_path / "host-a", small_seed[0], token, *ca, "--kind", "prepare")
    agent.start()
    try:
        done = wait_for(
            lambda: (j := tls_coordinator.get(f"/api/jobs/{job['id']}"))["state"] in {"succeeded", "failed"} and j,
            120,
            lambda: f"the prepare job to finish over https; agent log: {agent.log()[-2000:]}",
        )
        assert done["state"] == "succeeded", agent.log()[-3000:]
        (attempt,) = tls_coordinator.get(f"/api/jobs/{job['id']}/attempts")
        assert attempt["agent_id"] == _agents(tls_coordinator)["host-a"]["id"]
        wait_for(lambda: set(agent.spool()) == {"acknowledged"}, 30, "every upload to be acknowledged over https")
        _, actions = _what_the_token_did(tls_coordinator, "host-a")
        assert {"agent.register", "job.claim", "attempt.start", "attempt.events", "attempt.result"} <= set(actions)
    finally:
        agent.stop()


@pytest.mark.parametrize("mismatch", ["another CA", "another host name"])
def test_an_agent_whose_coordinator_does_not_verify_exits_2_and_never_sends_its_token(
    tls_coordinator: CoordinatorProcess,
    certificate: ServerFiles,
    small_seed: tuple[Path, seedmodel.Snapshot],
    tmp_path: Path,
    mismatch: str,
) -> None:
    token = tls_coordinator.agent_token("host-a")
    if mismatch == "another CA":
        ca_file, url, failure = Authority("another CA").write_ca(tmp_path / "other-ca.pem"), None, "local issuer"
    else:  # the certificate names 127.0.0.1 only
        ca_file, url, failure = certificate.ca_file, f"https://localhost:{tls_coordinator.port}", "localhost"
    agent = AgentProcess(
        tls_coordinator, "host-a", tmp_path / "host-a", small_seed[0], token, "--ca-file", str(ca_file), url=url
    )
    agent.start()
    assert agent.process is not None
    try:
        assert agent.process.wait(timeout=60) == 2, agent.log()[-2000:]
    finally:
        agent.stop()
    log = agent.log()
    refusal = f"coop-agent: the coordinator {url or tls_coordinator.url} failed TLS verification"
    assert refusal in log and failure in log and "the agent token was not sent" in log, log[-2000:]
    assert "Traceback" not in log
    # The coordinator's own records: the token registered no agent and did nothing; no request reached the app.
    assert _what_the_token_did(tls_coordinator, "host-a") == ([], [])
    assert "host-a" not in _agents(tls_coordinator)
    assert "/api/agents/register" not in tls_coordinator.log()


def _agent_run(
    tmp_path: Path, *arguments: str, token: str | None = "coop_secret-token", **environment: str
) -> subprocess.CompletedProcess[str]:
    """``coop-agent run`` to its end (each case here ends before it reaches any coordinator)."""
    env = {key: value for key, value in os.environ.items() if key != "COOP_AGENT_TOKEN"} | environment
    if token is not None:
        env["COOP_AGENT_TOKEN"] = token
    base = ["--name", "host-a", "--advertise-address", "127.0.0.1", "--work-dir", str(tmp_path / "work")]
    return subprocess.run(
        [sys.executable, "-m", "agent", "run", *base, *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://192.0.2.1:8000", "refusing plain http to the coordinator http://192.0.2.1:8000"),
        ("http://coordinator.example:8000", "its host coordinator.example is not loopback"),
        ("http://[2001:db8::1]:8000", "is not loopback"),
        ("ftp://127.0.0.1:8000", "must be http(s)://HOST[:PORT]"),
    ],
)
def test_an_agent_refuses_a_coordinator_url_that_would_carry_its_token_in_clear(
    tmp_path: Path, url: str, message: str
) -> None:
    refused = _agent_run(tmp_path, "--coordinator", url)
    assert refused.returncode == 2, refused.stderr
    assert message in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "work" / "spool.sqlite3").exists()  # refused before the agent began anything


def test_an_agent_refuses_a_ca_file_it_cannot_use_or_does_not_need(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    cases = {
        ("https://127.0.0.1:9", str(not_pem)): "holds no PEM certificate",
        ("https://127.0.0.1:9", str(tmp_path / "absent.pem")): "does not exist",
        ("http://127.0.0.1:9", str(not_pem)): "--ca-file verifies an https:// coordinator",
    }
    for (url, ca_file), message in cases.items():
        refused = _agent_run(tmp_path, "--coordinator", url, "--ca-file", ca_file)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("token_from", ["file", "environment"])
def test_the_token_from_a_file_or_the_environment_works_and_is_never_in_the_agents_argv(
    coordinator: CoordinatorProcess,
    small_seed: tuple[Path, seedmodel.Snapshot],
    tmp_path: Path,
    token_from: Literal["file", "environment"],
) -> None:
    token = coordinator.agent_token("host-a")
    agent = AgentProcess(coordinator, "host-a", tmp_path / "host-a", small_seed[0], token, token_from=token_from)
    agent.start()
    assert agent.process is not None
    try:
        wait_for(lambda: "host-a" in _agents(coordinator), 30, lambda: f"the agent to register: {agent.log()[-2000:]}")
        argv = Path(f"/proc/{agent.process.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"agent") + 1] == b"run"  # it is the agent's own command line
        assert not any(token.encode() in part for part in argv)
        assert b"--token" not in argv
    finally:
        agent.stop()


def test_an_agent_without_a_usable_token_exits_2_with_a_message(tmp_path: Path) -> None:
    url = ("--coordinator", "http://127.0.0.1:9")
    shared, empty = tmp_path / "shared-token", tmp_path / "empty-token"
    shared.write_text("coop_secret-token\n")
    shared.chmod(0o644)
    empty.touch(mode=0o600)
    me = pwd.getpwuid(os.geteuid()).pw_name
    cases = {
        (): "an agent token is needed: give --token-file FILE or set COOP_AGENT_TOKEN",
        ("--token-file", str(tmp_path / "absent")): "does not exist",
        ("--token-file", str(shared)): f"0644) is open to users other than {me}; make it private: chmod 600 {shared}",
        ("--token-file", str(empty)): "is empty",
    }
    for arguments, message in cases.items():
        refused = _agent_run(tmp_path, *url, *arguments, token=None)
        assert refused.returncode == 2 and message in refused.stderr, (arguments, refused.stderr)
        assert "Traceback" not in refused.stderr
    # --token is gone: refused by name (not read as --token-file), and the token is not repeated in the message.
    old = _agent_run(tmp_path, *url, "--token", "coop_secret-token", token=None)
    assert old.returncode == 2 and "--token is refused" in old.stderr and "coop_secret-token" not in old.stderr


def test_an_agent_whose_durable_folders_are_on_a_mount_a_stop_erases_exits_2_naming_each(tmp_path: Path) -> None:
    """/dev/shm, a real tmpfs, named as the instance store is (--ephemeral-mount): the work folder and the reference
    home on it are refused, each with its mount; the seed folder on the root volume is not named; nothing is made."""
    shm = Path("/dev/shm")
    assert any(line.split()[1] == str(shm) for line in Path("/proc/self/mounts").read_text().splitlines())
    work, reference = shm / f"coop-work-{uuid.uuid4().hex}", shm / f"coop-reference-{uuid.uuid4().hex}"
    refused = _agent_run(
        tmp_path,
        "--coordinator",
        "http://127.0.0.1:9",
        "--work-dir",
        str(work),
        "--reference-home",
        str(reference),
        "--ephemeral-mount",
        str(shm),
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    lines = refused.stderr.splitlines()
    assert [line.split(" is on ")[0] for line in lines] == [
        f"coop-agent: the work folder {work}",
        f"coop-agent: the reference home {reference}",
    ]
    assert all(f" is on {shm} (tmpfs from " in line and "a stop of this host erases" in line for line in lines)
    assert not work.exists() and not reference.exists()


def test_the_token_file_wins_over_the_environment(
    coordinator: CoordinatorProcess,
    small_seed: tuple[Path, seedmodel.Snapshot],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COOP_AGENT_TOKEN", "coop_not-the-agents-token")  # inherited by the agent beside its file
    token = coordinator.agent_token("host-a")
    agent = AgentProcess(coordinator, "host-a", tmp_path / "host-a", small_seed[0], token)
    agent.start()
    try:
        wait_for(lambda: "host-a" in _agents(coordinator), 30, lambda: f"the agent to register: {agent.log()[-2000:]}")
    finally:
        agent.stop()
