"""A throwaway PKI for runs on one machine: a CA, and leaf certificates it signs for 127.0.0.1 and
localhost (ECDSA P-256, valid from a day ago to a day from now). The all-reduce bench's `tls` mode
(`bench/allreduce.py`) and the trust tests use it."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

CertificateAuthority = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def make_ca(common_name: str) -> CertificateAuthority:
    """A self-signed CA certificate and its key."""
    key, name = _key_and_name(common_name)
    cert = _builder(name, name, key).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True
    )
    return cert.sign(key, hashes.SHA256()), key


def make_leaf(ca: CertificateAuthority, common_name: str) -> tuple[bytes, bytes]:
    """A certificate naming `common_name`, signed by `ca`, and its key: both PEM."""
    key, name = _key_and_name(common_name)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        _builder(name, ca[0].subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(san, critical=False)
        .sign(ca[1], hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_pki(keys: Path, node_ids: list[str]) -> None:
    """A CA (`ca.pem`) and, per node id, a certificate naming it (`ID.pem`, key `ID.pem.key`)."""
    ca = make_ca("bench CA")
    (keys / "ca.pem").write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    for node_id in node_ids:
        cert, key = make_leaf(ca, node_id)
        (keys / f"{node_id}.pem").write_bytes(cert)
        (keys / f"{node_id}.pem.key").write_bytes(key)


def _key_and_name(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name)])
    return ec.generate_private_key(ec.SECP256R1()), name


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
