"""Throwaway certificates for TLS tests, made with the openssl command line (EC P-256, valid two days)."""

from __future__ import annotations

import pathlib
import subprocess
from dataclasses import dataclass

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class CertPair:
    cert: pathlib.Path
    key: pathlib.Path

    def read(self) -> tuple[bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(directory: pathlib.Path, name: str) -> CertPair:
    """A self-signed certificate authority."""
    pair = CertPair(directory / f"{name}.pem", directory / f"{name}.key")
    _openssl(
        "req",
        "-x509",
        *EC_KEY,
        "-keyout",
        str(pair.key),
        "-out",
        str(pair.cert),
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return pair


def make_cert(
    directory: pathlib.Path,
    name: str,
    ca: CertPair,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
) -> CertPair:
    """A certificate signed by `ca`, usable by servers (for `hosts`) and as a client certificate."""
    pair = CertPair(directory / f"{name}.pem", directory / f"{name}.key")
    csr, extensions = directory / f"{name}.csr", directory / f"{name}.ext"
    names = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}" for h in hosts)
    extensions.write_text(
        f"subjectAltName={names}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    _openssl("req", *EC_KEY, "-keyout", str(pair.key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca.cert),
        "-CAkey",
        str(ca.key),
        "-CAcreateserial",
        "-out",
        str(pair.cert),
        "-days",
        "2",
        "-extfile",
        str(extensions),
    )
    return pair


@dataclass(frozen=True)
class Pki:
    """A CA with a server and a client certificate, plus a rogue CA (and client) nobody trusts."""

    ca: CertPair
    server: CertPair
    client: CertPair
    rogue_ca: CertPair
    rogue_client: CertPair


def make_pki(directory: pathlib.Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca, rogue_ca = make_ca(directory, "ca"), make_ca(directory, "rogue-ca")
    return Pki(
        ca,
        make_cert(directory, "server", ca),
        make_cert(directory, "client", ca),
        rogue_ca,
        make_cert(directory, "rogue-client", rogue_ca),
    )


class SecretVolume:
    """A directory laid out as the kubelet writes a Secret or projected volume: the files live in a timestamped
    directory behind the symlink `..data`, each name is a symlink through it, and an update swaps `..data` at once."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.generation = 0
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def publish(self, files: dict[str, bytes]) -> None:
        """Replaces the whole content with `files` (names may hold one directory level: `trust/ca.crt`)."""
        self.generation += 1
        data = self.directory / f"..{self.generation:04d}"
        for name, content in files.items():
            (data / name).parent.mkdir(parents=True, exist_ok=True)
            (data / name).write_bytes(content)
        swap = self.directory / "..data_tmp"
        swap.symlink_to(data.name)
        swap.rename(self.directory / "..data")  # atomic, as the kubelet's
        for top in {name.split("/")[0] for name in files}:
            link = self.directory / top
            if not link.is_symlink():
                link.symlink_to(f"..data/{top}")
