"""A small certificate authority for a test or compose cluster: ``fs3 admin certs init``.

One directory holds the CA (``ca.pem``, ``ca.key``), a certificate and key per node
(``NAME.pem``, ``NAME.key``: usable as server and as client, since nodes call each other) and one
for clients (``client.pem``, ``client.key``: client use only, so a client's key cannot pose as a
server). Every key file is 0600 and the directory 0700. Running it again keeps what exists and adds
what is missing, signed by the same CA: a cluster grows a node without re-issuing the others. A
node certificate that lacks a host name now asked for (a public name added after the first run,
as docker-compose's ``FS3_PUBLIC_HOST``) is issued again for the same key, naming its old hosts
and the new ones: peers keep trusting it, and a service picks it up when it restarts.

Keys are ECDSA P-256: small, and cheap to verify in the handshakes a restarting cluster makes.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import make_private_dir
from fs3.rpc.tls import TlsConfig

if TYPE_CHECKING:
    from cryptography import x509

__all__ = ["CLIENT", "CertFiles", "init_certs", "parse_node_specs", "tls_config"]

CLIENT = "client"
CA = "ca"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
CA_DAYS = 3650
CERT_DAYS_DEFAULT = 825


@dataclass(frozen=True)
class CertFiles:
    """What :func:`init_certs` made (or found) for one name."""

    name: str
    cert: Path
    key: Path
    created: bool
    reissued: bool = False  # an existing key's certificate signed again, to name more hosts


def tls_config(directory: Path, name: str, server_name: str = "") -> TlsConfig:
    """The ``[tls]`` table for node (or ``client``) ``name`` of the certificates in ``directory``."""
    directory = directory.resolve()
    return TlsConfig(ca_file=str(directory / f"{CA}.pem"), cert_file=str(directory / f"{name}.pem"),
                     key_file=str(directory / f"{name}.key"), server_name=server_name)


def parse_node_specs(hosts: str | None, nodes: Iterable[str], every_node: Iterable[str] = ()) -> dict[str, list[str]]:
    """Node name -> its certificate's host names and addresses, from ``--hosts h1,h2`` (each host
    its own node), ``--node NAME=H1,H2`` (repeatable) and ``--san H1,H2`` (repeatable: names every
    node's certificate carries too, such as one public host all nodes are reached by).

    Empty entries of ``--hosts`` and ``--san`` are skipped, so that a compose file can pass
    ``--san "${FS3_PUBLIC_HOST:-}"`` whether or not the variable is set."""
    out: dict[str, list[str]] = {}
    for host in (h.strip() for h in (hosts or "").split(",")):
        if host:
            out.setdefault(host, []).append(host)
    for spec in nodes:
        name, sep, names = spec.partition("=")
        sans = [h.strip() for h in names.split(",") if h.strip()]
        if not sep or not sans:
            raise InvalidArgument(f"bad node spec {spec!r}: expected NAME=HOST[,HOST...]")
        out.setdefault(name.strip(), []).extend(sans)
    shared = [h.strip() for spec in every_node for h in spec.split(",") if h.strip()]
    for sans in out.values():
        sans.extend(h for h in shared if h not in sans)
    for name, sans in out.items():
        if not _NAME.fullmatch(name) or name in (CA, CLIENT):
            raise InvalidArgument(f"bad node name {name!r}: letters, digits, '.', '_' and '-', not {CA!r} or "
                                  f"{CLIENT!r}")
        for san in sans:
            _san(san)
    if not out:
        raise InvalidArgument("give the nodes' hosts: --hosts h1,h2,... or --node NAME=HOST,...")
    return out


def _san(host: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,252})", host):
        raise InvalidArgument(f"bad host name {host!r} for a certificate")
    return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    """Created 0600 from the first byte (never world-readable, not even for a moment)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    tmp.replace(path)


def init_certs(directory: Path, nodes: Mapping[str, list[str]], *, client: bool = True,
               days: int = CERT_DAYS_DEFAULT, cluster: str = "fs3") -> list[CertFiles]:
    """Make (or reuse) the CA in ``directory`` and a certificate per node of ``nodes`` (name -> host
    names and IPs it is reached by), and one for clients; returns every certificate, CA first."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not 1 <= days <= 3650:
        raise InvalidArgument("certificate lifetime must be within [1, 3650] days")
    make_private_dir(directory)  # 0700, and refused when another user owns it (it could plant a CA)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # a little slack for clocks behind ours

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_cert_path, ca_key_path = directory / f"{CA}.pem", directory / f"{CA}.key"
    made: list[CertFiles] = []
    if ca_cert_path.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise InvalidArgument(f"{ca_key_path}: not an EC key made by fs3 admin certs init")
        ca_key = loaded
        made.append(CertFiles(CA, ca_cert_path, ca_key_path, created=False))
    elif ca_cert_path.exists() or ca_key_path.exists():
        raise InvalidArgument(f"{directory} has only one of {CA}.pem and {CA}.key: remove it or restore the other")
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
                             x509.NameAttribute(NameOID.COMMON_NAME, f"{cluster} cluster CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(now + dt.timedelta(days=CA_DAYS))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                key_cert_sign=True, crl_sign=True, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA256()))
        _write_private(ca_key_path, pem_key(ca_key))
        _write_public(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM))
        made.append(CertFiles(CA, ca_cert_path, ca_key_path, created=True))

    wanted: dict[str, tuple[list[str], bool]] = {name: (list(sans), True) for name, sans in nodes.items()}
    if client:
        wanted[CLIENT] = ([], False)
    for name, (sans, is_node) in wanted.items():
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        general_names = _unique([_san(h) for h in sans])
        reissue = False
        if cert_path.exists() and key_path.exists():
            present = _cert_sans(cert_path)
            missing = [n for n in general_names if n not in present]
            if not missing:
                made.append(CertFiles(name, cert_path, key_path, created=False))
                continue
            # Keep the key (nothing a peer holds changes) and every host the old certificate named
            # (clients may still dial it by them); sign again naming the missing ones too.
            loaded_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(loaded_key, ec.EllipticCurvePrivateKey):
                raise InvalidArgument(f"{key_path}: not an EC key made by fs3 admin certs init")
            key, general_names, reissue = loaded_key, [*present, *missing], True
        else:
            key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if is_node \
            else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
                                            x509.NameAttribute(NameOID.COMMON_NAME, f"{cluster}-{name}")]))
                   .issuer_name(ca_cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=True,
                                                key_cert_sign=False, crl_sign=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if general_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(general_names), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        if not reissue:
            _write_private(key_path, pem_key(key))
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        made.append(CertFiles(name, cert_path, key_path, created=not reissue, reissued=reissue))
    return made


def _unique(names: list[x509.GeneralName]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for n in names:
        if n not in out:
            out.append(n)
    return out


def _cert_sans(path: Path) -> list[x509.GeneralName]:
    """The host names and addresses an existing certificate names (none: no SAN extension)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        raise InvalidArgument(f"{path}: not a PEM certificate; remove it (and its key) to make a new one") from None
    try:
        return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return []
