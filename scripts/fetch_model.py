"""Fill a model directory from an object store, a hub (or its mirror), an HTTP(S) tarball or a local path.

    python scripts/fetch_model.py URI DEST

URI is one of
  file:///PATH              a model directory, or a tarball of one (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz)
  http(s)://HOST/PATH       a tarball of a model directory, streamed (a presigned S3 or signed GCS URL works)
  hf://ORG/NAME[@REVISION]  a Hugging Face Hub repository (HF_ENDPOINT points at a mirror, HF_TOKEN authenticates)
  s3://BUCKET/PREFIX        every object under PREFIX (needs boto3; credentials the usual AWS way)
  gs://BUCKET/PREFIX        every object under PREFIX (needs google-cloud-storage; credentials the usual GCP way)

The files land in DEST.incoming first and replace DEST only when complete, so a reader never sees half a
model; DEST/.specdec-source then holds the URI, and a second run with the same URI does nothing (a Job can
run again). A tarball with one top-level directory is unpacked from inside it. DEST must end up holding
config.json (an HF model directory) unless --no-check. Used by the Kubernetes Job in
k8s/overlays/gpu/models-fetch.yaml; needs only the standard library for file:// and http(s)://.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tarfile
import urllib.parse
import urllib.request
from typing import IO

SOURCE_FILE = ".specdec-source"
TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
HTTP_TIMEOUT_S = 60


class FetchError(Exception):
    """A URI that cannot be fetched, with the reason."""


def fetched_from(dest: pathlib.Path) -> str | None:
    """The URI dest was filled from, or None when it was not filled completely by this script."""
    marker = dest / SOURCE_FILE
    return marker.read_text().strip() if marker.is_file() else None


def unpack_stream(stream: IO[bytes], into: pathlib.Path) -> None:
    """Unpacks a (compressed) tar stream into `into`, refusing members that would land outside it or are
    links, devices or other special files."""
    with tarfile.open(fileobj=stream, mode="r|*") as archive:
        for member in archive:
            target = (into / member.name).resolve()
            if not target.is_relative_to(into.resolve()) or not (member.isfile() or member.isdir()):
                raise FetchError(f"tarball member {member.name!r} is a link, special file or outside the model")
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.extractfile(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)


def is_tarball(name: str) -> bool:
    return name.lower().endswith(TARBALL_SUFFIXES)


def fetch_file(path: str, into: pathlib.Path) -> None:
    source = pathlib.Path(urllib.parse.unquote(path))
    if source.is_dir():
        shutil.copytree(source, into, dirs_exist_ok=True)
    elif source.is_file() and is_tarball(source.name):
        with open(source, "rb") as stream:
            unpack_stream(stream, into)
    else:
        raise FetchError(f"{source}: not a directory or a tarball ({', '.join(TARBALL_SUFFIXES)})")


def fetch_http(uri: str, into: pathlib.Path) -> None:
    request = urllib.request.Request(uri, headers={"User-Agent": "specdec-fetch-model"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            unpack_stream(response, into)
    except OSError as error:  # URLError and HTTPError are OSErrors
        raise FetchError(f"{uri}: {error}") from None
    except tarfile.TarError as error:
        raise FetchError(f"{uri}: not a tarball of a model directory ({error})") from None


def fetch_hub(repo: str, into: pathlib.Path) -> None:
    from huggingface_hub import snapshot_download  # installed with transformers

    repo_id, _, revision = repo.partition("@")
    snapshot_download(repo_id, revision=revision or None, local_dir=into)
    shutil.rmtree(into / ".cache", ignore_errors=True)  # the download's bookkeeping, not the model


def fetch_s3(bucket: str, prefix: str, into: pathlib.Path) -> None:
    try:
        import boto3
    except ImportError:
        raise FetchError(
            "s3:// needs boto3, which the service image does not install: build an image FROM it with "
            "`pip install boto3`, or pass a presigned https:// URL of a tarball instead"
        ) from None
    client = boto3.client("s3")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    names = [item["Key"] for page in pages for item in page.get("Contents", [])]
    copy_objects(names, prefix, into, lambda name, path: client.download_file(bucket, name, str(path)))


def fetch_gs(bucket: str, prefix: str, into: pathlib.Path) -> None:
    try:
        from google.cloud import storage
    except ImportError:
        raise FetchError(
            "gs:// needs google-cloud-storage, which the service image does not install: build an image FROM "
            "it with `pip install google-cloud-storage`, or pass a signed https:// URL of a tarball instead"
        ) from None
    blobs = {blob.name: blob for blob in storage.Client().list_blobs(bucket, prefix=prefix)}
    copy_objects(list(blobs), prefix, into, lambda name, path: blobs[name].download_to_filename(str(path)))


def copy_objects(names: list[str], prefix: str, into: pathlib.Path, download) -> None:
    """download(name, path) for each object name under `prefix`, to its path relative to the prefix."""
    count = 0
    for name in names:
        relative = name[len(prefix) :].lstrip("/")
        if not relative or name.endswith("/"):
            continue
        target = (into / relative).resolve()
        if not target.is_relative_to(into.resolve()):
            raise FetchError(f"object {name!r} would land outside the model")
        target.parent.mkdir(parents=True, exist_ok=True)
        download(name, target)
        count += 1
    if not count:
        raise FetchError(f"no objects under {prefix!r}")


def fetch_into(uri: str, into: pathlib.Path) -> None:
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme == "file":
        fetch_file(parts.path, into)
    elif parts.scheme in ("http", "https"):
        fetch_http(uri, into)
    elif parts.scheme == "hf":
        fetch_hub(f"{parts.netloc}{parts.path}", into)
    elif parts.scheme == "s3":
        fetch_s3(parts.netloc, parts.path.lstrip("/"), into)
    elif parts.scheme == "gs":
        fetch_gs(parts.netloc, parts.path.lstrip("/"), into)
    else:
        raise FetchError(f"{uri}: unknown scheme {parts.scheme!r} (file, http, https, hf, s3, gs)")


def lift_single_directory(into: pathlib.Path) -> None:
    """A tarball of `model-name/...` puts the model one level down: move it up."""
    entries = list(into.iterdir())
    if len(entries) == 1 and entries[0].is_dir():
        inner = entries[0].rename(into.with_name(into.name + ".inner"))
        into.rmdir()
        inner.rename(into)


def check_writable(directory: pathlib.Path) -> None:
    """FetchError naming the owner and mode when this process may not create files in `directory` (a shared volume
    whose driver does not apply the pod's fsGroup: k8s/README.md, "Model weights"); a directory still to be made
    is checked where it would be made."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    if os.access(directory, os.W_OK | os.X_OK):
        return
    status = directory.stat()
    raise FetchError(
        f"{directory} is not writable by uid {os.getuid()} gid {os.getgid()} (groups {sorted(os.getgroups())}): "
        f"it is owned by {status.st_uid}:{status.st_gid} with mode {status.st_mode & 0o7777:04o}; its storage "
        "driver did not apply the pod's fsGroup. Give the volume to that uid or gid once (k8s/README.md, "
        '"Model weights": an EFS access point, or components/models-volume-owner)'
    )


def fetch_model(uri: str, dest: pathlib.Path, check: bool = True) -> bool:
    """Fills dest from uri unless it was filled from uri already; True when it fetched."""
    if fetched_from(dest) == uri:
        return False
    check_writable(dest.parent)
    incoming, previous = dest.with_name(dest.name + ".incoming"), dest.with_name(dest.name + ".previous")
    for leftover in (incoming, previous, incoming.with_name(incoming.name + ".inner")):
        shutil.rmtree(leftover, ignore_errors=True)
    incoming.mkdir(parents=True)
    try:
        fetch_into(uri, incoming)
        lift_single_directory(incoming)
        if check and not (incoming / "config.json").is_file():
            raise FetchError(f"{uri}: no config.json at the top: not a Hugging Face model directory")
        (incoming / SOURCE_FILE).write_text(uri + "\n")
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    if dest.exists():
        dest.rename(previous)
    incoming.rename(dest)
    shutil.rmtree(previous, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("uri", help="file://, http(s)://, hf://, s3:// or gs:// (see above)")
    parser.add_argument("dest", type=pathlib.Path, help="the model directory to fill (replaced when complete)")
    parser.add_argument("--no-check", action="store_true", help="do not require config.json at the top")
    args = parser.parse_args(argv)
    try:
        fetched = fetch_model(args.uri, args.dest, check=not args.no_check)
    except FetchError as error:
        print(f"fetch_model: {error}", file=sys.stderr)
        return 1
    print(f"{args.dest}: {'filled from' if fetched else 'already holds'} {args.uri}", flush=True)
    return 0


if __name__ == "__main__":
    os.umask(0o022)  # readable by every pod that mounts the volume, whatever their user
    sys.exit(main())
