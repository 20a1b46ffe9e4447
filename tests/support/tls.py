"""Certificates for the TLS tests, made with ``cryptography``: a test CA and the coordinator's certificate it signs,
for the addresses and names the test gives, written as the PEM files ``coop-server serve`` and ``coop-agent`` read."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAY = datetime.timedelta(days=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class ServerFiles:
    """What a TLS coordinator serves with, and the CA file its agents verify it against."""

    certfile: Path
    keyfile: Path
    ca_file: Path

    def client_context(self) -> ssl.SSLContext:
        """A client's context that trusts this CA only."""
        return ssl.create_default_context(cafile=str(self.ca_file))


class Authority:
    """A self-signed CA, valid from yesterday for a week."""

    def __init__(self, common_name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY)
            .not_valid_after(now + 7 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )  # keyCertSign and cRLSign only
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def write_ca(self, path: Path) -> Path:
        path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        return path

    def issue(
        self,
        folder: Path,
        *,
        addresses: tuple[str, ...] = ("127.0.0.1",),
        names: tuple[str, ...] = (),
        days: int = 7,
    ) -> ServerFiles:
        """A server certificate for ``addresses`` (IP SANs) and ``names`` (DNS SANs), valid from yesterday for
        ``days`` more days (0: it expired an hour ago), its key and this CA, written into ``folder`` as
        coordinator.pem, coordinator.key (mode 0600) and ca.pem."""
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        ends = now + days * DAY if days else now - datetime.timedelta(hours=1)
        alternatives: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
        alternatives += [x509.DNSName(name) for name in names]
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name("coop coordinator"))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY)
            .not_valid_after(ends)
            .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        certfile, keyfile = folder / "coordinator.pem", folder / "coordinator.key"
        certfile.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        keyfile.touch(mode=0o600)
        keyfile.write_bytes(_pem(key))
        return ServerFiles(certfile, keyfile, self.write_ca(folder / "ca.pem"))


def other_key(path: Path) -> Path:
    """A private key that belongs to no certificate (for a mismatched pair)."""
    path.touch(mode=0o600)
    path.write_bytes(_pem(ec.generate_private_key(ec.SECP256R1())))
    return path
