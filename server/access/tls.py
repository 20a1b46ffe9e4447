"""The coordinator's TLS certificate and key, checked before uvicorn starts, so that a wrong file is one message
and exit 2 rather than a traceback from inside the server."""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from experiment.core import secretfile
from experiment.core.errors import CoopError


@dataclass(frozen=True)
class Certificate:
    """A PEM certificate (its chain may follow it in the file) and the PEM private key that matches it."""

    certfile: Path
    keyfile: Path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CoopError(f"the {what} {path} does not exist") from None
    except OSError as exc:
        raise CoopError(f"cannot read the {what} {path}: {exc.strerror}") from None


def check(certfile: Path, keyfile: Path) -> Certificate:
    """The pair, once both files are readable PEM, the key is the certificate's, it is valid now, and Python's ssl
    module (uvicorn's) loads them, and the key file belongs to this user alone (experiment.core.secretfile); else a
    CoopError saying which of those failed."""
    try:
        certificate = x509.load_pem_x509_certificate(_read(certfile, "certificate file"))
    except ValueError as exc:
        raise CoopError(f"the certificate file {certfile} holds no PEM certificate: {exc}") from None
    try:
        key = serialization.load_pem_private_key(secretfile.read(keyfile, "key file"), password=None)
    except TypeError:
        raise CoopError(f"the key file {keyfile} is encrypted; give the coordinator an unencrypted key") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CoopError(f"the key file {keyfile} holds no PEM private key: {exc}") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != certificate.public_key().public_bytes(*spki):
        raise CoopError(f"the key in {keyfile} is not the key of the certificate in {certfile}")
    now = datetime.datetime.now(datetime.UTC)
    if certificate.not_valid_after_utc < now:
        raise CoopError(f"the certificate {certfile} expired at {certificate.not_valid_after_utc.isoformat()}")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:
        raise CoopError(f"the certificate {certfile} and key {keyfile} cannot serve TLS: {exc}") from None
    return Certificate(certfile, keyfile)
