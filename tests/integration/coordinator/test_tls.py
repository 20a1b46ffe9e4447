"""`coop-server serve --certfile --keyfile`: a real coordinator over HTTPS with a certificate of a CA the test makes;
its web cookies are Secure (and a plain coordinator's are not), and a certificate or key it cannot use is one
message and exit 2, never a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import pytest

from server.cli import GRACEFUL_SHUTDOWN_SECONDS
from tests.support import ROOT
from tests.support.processes import CoordinatorProcess, free_port
from tests.support.tls import Authority, ServerFiles, other_key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> ServerFiles:
    return Authority("coop test CA").issue(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def start_coordinator(tmp_path: Path) -> Iterator[Callable[[ServerFiles | None], CoordinatorProcess]]:
    started: list[CoordinatorProcess] = []

    def start(certificate: ServerFiles | None) -> CoordinatorProcess:
        home = tmp_path / f"coordinator-{len(started)}"
        home.mkdir()
        server = CoordinatorProcess(home, certificate=certificate)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.close()


def _cookies(response: httpx.Response) -> dict[str, str]:
    """Each Set-Cookie of ``response`` by name, as the header carried it."""
    found = {}
    for header in response.headers.get_list("set-cookie"):
        (name,) = SimpleCookie(header).keys()
        found[name] = header
    return found


def _secure(header: str) -> bool:
    return any(part.strip().lower() == "secure" for part in header.split(";"))


def _sign_in(server: CoordinatorProcess) -> tuple[dict[str, str], dict[str, str]]:
    """The cookies the sign-in page sets (CSRF), then those the sign-in sets (the session)."""
    page = server.http.get("/login")
    assert page.status_code == 200
    found = re.search(r'name="_csrf_token" value="([^"]+)"', page.text)
    assert found is not None
    signed_in = server.http.post(
        "/login", data={"token": server.operator, "next": "/", "_csrf_token": found.group(1)}, follow_redirects=False
    )
    assert signed_in.status_code == 303, signed_in.text
    return _cookies(page), _cookies(signed_in)


def test_a_tls_coordinator_serves_https_and_its_session_and_csrf_cookies_are_secure(
    start_coordinator: Callable[[ServerFiles | None], CoordinatorProcess], certificate: ServerFiles
) -> None:
    server = start_coordinator(certificate)
    assert server.url.startswith("https://127.0.0.1:")
    assert server.get("/health") == {"status": "ok"}
    page, signed_in = _sign_in(server)
    assert _secure(page["coop_csrf"]) and _secure(signed_in["coop_session"]) and _secure(signed_in["coop_csrf"])
    assert server.http.get("/login").headers["strict-transport-security"] == "max-age=31536000"
    # Plain HTTP to the TLS port gets no answer from the app.
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5).raise_for_status()


def test_a_tls_coordinator_stops_on_term_with_a_clients_idle_connection_open(
    start_coordinator: Callable[[ServerFiles | None], CoordinatorProcess], certificate: ServerFiles
) -> None:
    """An agent's keep-alive connection is idle between its calls. uvicorn's graceful shutdown waited for it to
    close, which over TLS it never does: the coordinator hung on TERM until it was killed."""
    server = start_coordinator(certificate)
    assert server.get("/health") == {"status": "ok"}  # the client now holds an idle keep-alive connection
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    # It ends by itself once the grace period is over (uvicorn then ends by the signal it was sent).
    assert server.process.wait(timeout=GRACEFUL_SHUTDOWN_SECONDS + 10) in {0, -signal.SIGTERM}
    assert "Shutting down" in server.log()


def test_a_plain_coordinators_cookies_are_not_secure(
    start_coordinator: Callable[[ServerFiles | None], CoordinatorProcess],
) -> None:
    server = start_coordinator(None)
    page, signed_in = _sign_in(server)
    assert not _secure(page["coop_csrf"]) and not _secure(signed_in["coop_session"])
    assert "httponly" in signed_in["coop_session"].lower()
    assert "strict-transport-security" not in server.http.get("/login").headers  # HSTS only over TLS


def _serve(home: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(free_port()), *arguments]
    env = {**os.environ, "COOP_HOME": str(home)}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _private_copy(path: Path, folder: Path) -> Path:
    copy = folder / f"private-{path.name}"
    copy.touch(mode=0o600)
    copy.write_bytes(path.read_bytes())
    return copy


def _opened_copy(path: Path, folder: Path) -> Path:
    copy = _private_copy(path, folder)
    copy.chmod(0o640)
    return copy


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing certificate", "does not exist"),
        ("missing key", "does not exist"),
        ("unreadable certificate", "cannot read the certificate file"),
        ("key of another certificate", "is not the key of the certificate"),
        ("key given as certificate", "holds no PEM certificate"),
        ("certificate given as key", "holds no PEM private key"),
        ("certificate without key", "needs both --certfile and --keyfile"),
        ("key open to others", "is open to users other than"),
        ("expired certificate", "expired at"),
    ],
)
def test_serve_refuses_a_certificate_or_key_it_cannot_use_with_a_message_and_exit_2(
    certificate: ServerFiles, tmp_path: Path, case: str, message: str
) -> None:
    cert, key = str(certificate.certfile), str(certificate.keyfile)
    arguments = {
        "missing certificate": ["--certfile", str(tmp_path / "absent.pem"), "--keyfile", key],
        "missing key": ["--certfile", cert, "--keyfile", str(tmp_path / "absent.key")],
        "unreadable certificate": ["--certfile", str(tmp_path), "--keyfile", key],  # a folder: not readable as a file
        "key of another certificate": ["--certfile", cert, "--keyfile", str(other_key(tmp_path / "other.key"))],
        "key given as certificate": ["--certfile", key, "--keyfile", key],
        "certificate given as key": ["--certfile", cert, "--keyfile", str(_private_copy(Path(cert), tmp_path))],
        "certificate without key": ["--certfile", cert],
        "key open to others": ["--certfile", cert, "--keyfile", str(_opened_copy(certificate.keyfile, tmp_path))],
        "expired certificate": [],
    }[case]
    if case == "expired certificate":
        expired = Authority("coop test CA").issue(tmp_path / "expired", days=0)
        arguments = ["--certfile", str(expired.certfile), "--keyfile", str(expired.keyfile)]
    refused = _serve(tmp_path / "home", *arguments)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("coop-server: ") and message in refused.stderr
    assert "Traceback" not in refused.stderr
