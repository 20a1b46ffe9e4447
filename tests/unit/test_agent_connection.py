"""How an agent may reach its coordinator: https verified (against the operator's CA alone when given), plain http to
loopback only; and its token, read from a file or the environment, is not left for the commands it starts."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest

from agent import cli, connection
from experiment.core.errors import CoopError
from tests.support.tls import Authority


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://127.9.9.9:8000", "http://localhost:8000", "http://[::1]:8000"]
)
def test_plain_http_to_loopback_is_allowed(url: str) -> None:
    assert connection.tls_context(url, None) is None


@pytest.mark.parametrize(
    "url", ["http://10.0.0.10:8000", "http://128.0.0.1:8000", "http://localhost.example:8000", "http://[::2]:8000"]
)
def test_plain_http_to_any_other_host_is_refused(url: str) -> None:
    with pytest.raises(CoopError, match="would cross the network in clear"):
        connection.tls_context(url, None)


def test_https_verifies_the_host_against_the_ca_file_alone(tmp_path: Path) -> None:
    ca_file = Authority("coop test CA").write_ca(tmp_path / "ca.pem")
    context = connection.tls_context("https://10.0.0.10:8443", ca_file)
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [ca["subject"] for ca in context.get_ca_certs()] == [((("commonName", "coop test CA"),),)]


def test_the_token_variable_is_read_once_and_not_inherited(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(cli.TOKEN_VARIABLE, " coop_from-the-environment\n")
    assert cli.read_token(None) == "coop_from-the-environment"
    assert cli.TOKEN_VARIABLE not in os.environ  # the agent's commands get a copy of os.environ
    token_file = tmp_path / "agent-token"
    token_file.touch(mode=0o600)
    token_file.write_text("coop_from-the-file\n")
    monkeypatch.setenv(cli.TOKEN_VARIABLE, "coop_from-the-environment")
    assert cli.read_token(token_file) == "coop_from-the-file"
    assert cli.TOKEN_VARIABLE not in os.environ
