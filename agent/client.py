"""The one HTTP client of the coordinator: typed with experiment.wire, retrying connection errors and 5xx
with exponential backoff, and sending the Idempotency-Key of every upload."""

from __future__ import annotations

import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import msgspec

from experiment import wire
from experiment.core.errors import CoopError

T = TypeVar("T")


log = logging.getLogger("coop.agent")


class Unreachable(CoopError):
    """The coordinator did not answer (or answered 5xx) after every retry; the caller may try again later."""


class Untrusted(CoopError):
    """The coordinator's TLS certificate did not verify: the handshake failed, so no request (and no token) was
    sent. Retrying will not help; the agent stops."""


def _verification_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error at the root of a transport error, if that is what it was."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class Rejected(CoopError):
    """The coordinator refused the request (4xx): retrying the same request will not help."""

    def __init__(self, status_code: int, detail: str, rule: str | None) -> None:
        super().__init__(f"{status_code}: {detail}" + (f" ({rule})" if rule else ""))
        self.status_code = status_code
        self.detail = detail
        self.rule = rule


def upload_key(job_id: uuid.UUID, attempt_id: uuid.UUID, sequence: int | str) -> str:
    """The Idempotency-Key the coordinator expects: job:attempt:sequence ('result' for the result)."""
    return f"{job_id}:{attempt_id}:{sequence}"


class Coordinator:
    """Calls of one agent token. ``retries`` extra tries per call, ``backoff`` seconds doubling up to 8 s."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retries: int = 4,
        backoff: float = 0.5,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
            verify=verify,
        )
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout

    def close(self) -> None:
        self._http.close()

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> httpx.Response:
        tries = (self.retries if retries is None else retries) + 1
        delay = self.backoff
        problem = "no try was made"
        for attempt in range(tries):
            if attempt:
                time.sleep(delay)
                delay = min(delay * 2, 8.0)
            try:
                response = self._http.request(
                    method,
                    path,
                    content=body,
                    headers={"Content-Type": "application/json", **(headers or {})},
                    timeout=timeout or self.timeout,
                )
            except httpx.TransportError as exc:
                failure = _verification_failure(exc)
                if failure is not None:
                    raise Untrusted(
                        f"the coordinator {self.base_url} failed TLS verification "
                        f"({failure.verify_message or failure.reason}); the agent token was not sent"
                    ) from None
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                try:
                    refusal = msgspec.json.decode(response.content, type=wire.Problem)
                    detail, rule = refusal.detail, refusal.rule
                except msgspec.DecodeError:
                    detail, rule = response.text[:500], None
                raise Rejected(response.status_code, detail, rule)
            return response
        raise Unreachable(f"{method} {path} failed {tries} times; last: {problem}")

    def _call(
        self,
        method: str,
        path: str,
        reply: type[T],
        payload: Any = None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> T:
        body = None if payload is None else msgspec.json.encode(payload)
        response = self._send(method, path, body=body, headers=headers, timeout=timeout, retries=retries)
        return msgspec.json.decode(response.content, type=reply)

    def register(self, body: wire.AgentRegister) -> wire.Agent:
        return self._call("POST", "/api/agents/register", wire.Agent, body)

    def heartbeat(self, body: wire.HeartbeatRequest, *, retries: int | None = None) -> wire.HeartbeatReply:
        return self._call("POST", "/api/agents/heartbeat", wire.HeartbeatReply, body, retries=retries)

    def claim(self, body: wire.ClaimRequest) -> wire.ClaimReply:
        # The long poll holds the request open up to wait_seconds: the read timeout must outlast it.
        return self._call("POST", "/api/agents/claim", wire.ClaimReply, body, timeout=body.wait_seconds + self.timeout)

    def start(self, attempt_id: uuid.UUID, lease_token: str) -> wire.Attempt:
        return self._call("POST", f"/api/attempts/{attempt_id}/start", wire.Attempt, wire.LeaseProof(lease_token))

    def upload_events(self, attempt_id: uuid.UUID, key: str, body: bytes) -> wire.EventBatchReply:
        """``body`` is an encoded wire.EventBatch, exactly as spooled, so that a replay sends the same bytes."""
        response = self._send("POST", f"/api/attempts/{attempt_id}/events", body=body, headers={"Idempotency-Key": key})
        return msgspec.json.decode(response.content, type=wire.EventBatchReply)

    def upload_result(self, attempt_id: uuid.UUID, key: str, body: bytes) -> wire.Attempt:
        """``body`` is an encoded wire.AttemptResult, exactly as spooled."""
        response = self._send("POST", f"/api/attempts/{attempt_id}/result", body=body, headers={"Idempotency-Key": key})
        return msgspec.json.decode(response.content, type=wire.Attempt)

    def upload_blob(self, attempt_id: uuid.UUID, sha256: str, data: bytes) -> wire.Blob:
        """``data``, evidence of the attempt (an agent's upload names it: the coordinator refuses one for an attempt
        that has ended)."""
        path = f"/api/blobs/{sha256}?attempt={attempt_id}"
        response = self._send("PUT", path, body=data, headers={"Content-Type": "application/octet-stream"})
        return msgspec.json.decode(response.content, type=wire.Blob)

    def ledger(self, experiment_id: uuid.UUID) -> list[wire.LedgerEntry]:
        return self._call("GET", f"/api/experiments/{experiment_id}/ledger", list[wire.LedgerEntry])

    def evidence(self, experiment_id: uuid.UUID) -> list[wire.EvidenceFile]:
        return self._call("GET", f"/api/experiments/{experiment_id}/evidence", list[wire.EvidenceFile])

    def download_blob(self, sha256: str) -> bytes:
        return self._send("GET", f"/api/blobs/{sha256}").content


class Stopping(CoopError):
    """The agent began to stop while it waited for the coordinator."""


def forever(call: Callable[[], T], stopping: threading.Event, pause: float = 1.0) -> T:
    """``call`` once the coordinator answers (it may be restarting); raises Stopping when ``stopping`` is set
    first. A refusal (Rejected) is not retried."""
    while not stopping.is_set():
        try:
            return call()
        except Unreachable as exc:
            log.warning("the coordinator is unreachable; retrying: %s", exc)
            stopping.wait(pause)
    raise Stopping("the agent is stopping")
