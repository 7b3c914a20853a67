"""Certificates that change under a running service: renewed by cert-manager, rotated to a new CA
(k8s/README.md, "Certificates"). Kubernetes swaps a Secret volume's files at once (a symlink flip), so a change
is seen by the files' identity (inode, mtime, size) and read whole.

- A server takes a renewed certificate, key or client CA on its next TLS handshake: grpc's dynamic server
  credentials ask `ReloadingTlsFiles.renewed` on each handshake, which answers a new configuration only when the
  files changed (specdec/serving/tls.py). Connections already open keep the certificate they began with.
- A client (the coordinator's channels to its replicas) asks `renewed` now and then and opens new channels with
  the credentials it returns (coordinator/replicas.py).
Files that do not make a valid set (a key that does not match its certificate) are logged and the set loaded
before stays in use, until the files change again.
"""

from __future__ import annotations

import logging
import os
import pathlib
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
CA_FILE_SUFFIXES = (".crt", ".pem")  # the files of a CA directory that are read
Loaded = TypeVar("Loaded")


def ca_files(path: str) -> list[pathlib.Path]:
    """A CA setting's files: the file itself, or a directory's *.crt and *.pem files (a Kubernetes projected volume
    holding the issuing CA and, during a rotation, the other one)."""
    directory = pathlib.Path(path)
    if not directory.is_dir():
        return [directory]
    return sorted(p for p in directory.iterdir() if p.suffix in CA_FILE_SUFFIXES and not p.name.startswith("."))


def stamp(paths: Sequence[str]) -> tuple:
    """The identity of the files behind `paths` (a directory: each of its CA files): changes when any is replaced."""
    identity = []
    for path in paths:
        for file in ca_files(path):
            try:
                status = os.stat(file)
            except OSError:
                identity.append((str(file), None))
                continue
            identity.append((str(file), status.st_ino, status.st_mtime_ns, status.st_size))
    return tuple(identity)


def check_key_pair(cert: str, key: str, prefix: str) -> None:
    """ValueError naming the settings when the key is not the certificate's."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"{prefix}_cert and {prefix}_key: {cert!r} and {key!r} are no key pair: {error}") from None


class ReloadingTlsFiles(Generic[Loaded]):
    """What `load` makes of some PEM files (a server's certificate configuration, a client's channel credentials),
    made anew when the files change. `renewed` may be called from any thread: grpc calls it on each handshake as
    the certificate configuration fetcher of its dynamic server credentials."""

    def __init__(self, what: str, paths: Sequence[str], load: Callable[[], Loaded]):
        self.what = what
        self._paths = [path for path in paths if path]
        self._load = load  # ValueError for files that make no valid set
        self._lock = threading.Lock()
        self._seen = stamp(self._paths)
        self.current = load()
        self.reloads = 0

    def renewed(self) -> Loaded | None:
        """The new set when the files changed since the last look (and make a valid set), else None."""
        if stamp(self._paths) == self._seen:
            return None
        with self._lock:
            current = stamp(self._paths)
            if current == self._seen:
                return None
            self._seen = current
            try:
                self.current = self._load()
            except ValueError as error:
                log.warning("%s files changed but make no valid set; keeping the loaded one: %s", self.what, error)
                return None
            self.reloads += 1
        log.info("%s reloaded from %s (reload %d)", self.what, ", ".join(self._paths), self.reloads)
        return self.current
