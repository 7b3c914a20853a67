"""Make the Secrets the Kubernetes manifests read (k8s/README.md, "Deploy"), with fresh values.

    python3 scripts/k8s_secrets.py --out ~/specdec-secrets [--namespace specdec] [--client NAME ...]
    kubectl apply -f ~/specdec-secrets/secrets.json

Writes `secrets.json` (a v1 List, for `kubectl apply -f`) holding
  specdec-redis       password (the bundled Redis's), url (what the coordinator and the key-seeding Job use;
                      --redis-url points them at a managed Redis instead)
  specdec-api-keys    one key per client name (--client, repeatable); the seeding Job stores their hashes in Redis
  specdec-tls         the server role: tls.crt / tls.key, a server certificate (serverAuth) for each Service's DNS
                      names, `localhost` (port-forwarding) and REPLICA_SERVER_NAME, the name the coordinator checks
                      draft and verify pods against (it dials their pod IPs); ca.crt: the CA that signed it
  specdec-tls-client  the client role, the coordinator's towards the replicas: a client certificate (clientAuth)
                      with a key pair of its own, and ca.crt
and beside it `ca.crt` for clients and `ca.key` (0600) to sign more certificates; keep that one offline. The CA in
the --ca directory (default: --out) is used when it is there, so running again renews the certificates under the
same CA; `--tls-only` writes only the two TLS Secrets (a renewal: apply them and the services reload them). Needs
Python 3.9+ and the openssl command line; the manifests never hold these values, so `kubectl apply -k` cannot
overwrite them. Certificates from your own CA work as well: k8s/components/cert-manager makes the same Secrets.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import re
import secrets
import subprocess
import sys
import tempfile

SERVICES = ("specdec-coordinator", "specdec-draft", "specdec-verify")
REPLICA_SERVER_NAME = "specdec-replicas"  # = SPECDEC_REPLICA_TLS_SERVER_NAME in k8s/base/config/coordinator.env
API_KEY_PREFIX = "sd-"  # as coordinator.api_keys makes them
# The keys of each Secret that the manifests read (specdec-api-keys: any client names, mounted as files).
SECRET_KEYS = {
    "specdec-redis": ("password", "url"),
    "specdec-tls": ("tls.crt", "tls.key", "ca.crt"),
    "specdec-tls-client": ("tls.crt", "tls.key", "ca.crt"),
    "specdec-api-keys": (),
}
TLS_SECRETS = ("specdec-tls", "specdec-tls-client")
CLIENT_COMMON_NAME = "specdec-coordinator"  # the client role's certificate (the servers check only its CA)
CLIENT_NAME = re.compile(r"^[-._a-zA-Z0-9]+$")  # a Secret key, and a name coordinator.api_keys accepts
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def dns_names(namespace: str, cluster_domain: str) -> list[str]:
    names = [REPLICA_SERVER_NAME, "localhost"]
    for service in SERVICES:
        names += [service, f"{service}.{namespace}", f"{service}.{namespace}.svc"]
        names.append(f"{service}.{namespace}.svc.{cluster_domain}")
    return names


def openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")


def make_ca(directory: pathlib.Path, days: int) -> None:
    """A CA (ca.crt, ca.key) in `directory`, unless it holds one already."""
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    if ca_key.is_file() and ca_crt.is_file():
        return
    openssl("req", "-x509", *EC_KEY, "-keyout", str(ca_key), "-out", str(ca_crt), "-days", str(days * 5),
            "-subj", "/CN=specdec CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    ca_key.chmod(0o600)


def sign(ca: pathlib.Path, scratch: pathlib.Path, role: str, subject: str, extensions: str, days: int) -> dict:
    """A new key pair and a certificate for it that the CA in `ca` signed: {tls.crt, tls.key, ca.crt}."""
    key, csr, crt, ext = (scratch / f"{role}.{suffix}" for suffix in ("key", "csr", "crt", "ext"))
    ext.write_text(extensions + "keyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n")
    openssl("req", *EC_KEY, "-keyout", str(key), "-out", str(csr), "-subj", subject)
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
            "-CAcreateserial", "-out", str(crt), "-days", str(days), "-extfile", str(ext))  # fmt: skip
    return {"tls.crt": crt.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": (ca / "ca.crt").read_bytes()}


def make_certificates(ca: pathlib.Path, names: list[str], days: int) -> dict[str, dict[str, bytes]]:
    """The server and the client role's material, each with a key pair of its own, from the CA in `ca` (made there
    when missing): {secret name: {tls.crt, tls.key, ca.crt}}."""
    make_ca(ca, days)
    with tempfile.TemporaryDirectory() as scratch:
        server_names = f"subjectAltName={','.join('DNS:' + n for n in names)},IP:127.0.0.1\n"
        return {
            "specdec-tls": sign(ca, pathlib.Path(scratch), "server", "/CN=specdec",
                                server_names + "extendedKeyUsage=serverAuth\n", days),
            "specdec-tls-client": sign(ca, pathlib.Path(scratch), "client", f"/CN={CLIENT_COMMON_NAME}",
                                       "extendedKeyUsage=clientAuth\n", days),
        }  # fmt: skip


def secret(name: str, namespace: str, data: dict[str, bytes], kind: str = "Opaque") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "specdec"}},
        "type": kind,
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def make_secrets(
    ca: pathlib.Path,
    namespace: str = "specdec",
    clients: tuple[str, ...] = ("default",),
    redis_url: str = "",
    cluster_domain: str = "cluster.local",
    days: int = 365,
    tls_only: bool = False,
) -> list[dict]:
    """The Secrets (only the TLS ones with tls_only), certificates signed by the CA in `ca` (made there if missing)."""
    bad = [name for name in clients if not CLIENT_NAME.match(name)]
    if bad or not clients:
        raise ValueError(f"client names must be letters, digits, '-', '_' or '.': {bad or 'none given'}")
    ca.mkdir(parents=True, exist_ok=True)
    roles = make_certificates(ca, dns_names(namespace, cluster_domain), days)
    objects = [secret(name, namespace, roles[name], "kubernetes.io/tls") for name in TLS_SECRETS]
    if tls_only:
        return objects
    password = secrets.token_hex(24)
    url = redis_url or f"redis://:{password}@specdec-redis:6379/0"
    keys = {name: (API_KEY_PREFIX + secrets.token_urlsafe(32)).encode() for name in clients}
    return [
        secret("specdec-redis", namespace, {"password": password.encode(), "url": url.encode()}),
        secret("specdec-api-keys", namespace, keys),
        *objects,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="directory for secrets.json (and the CA)")
    parser.add_argument("--ca", type=pathlib.Path, help="directory of the CA (ca.crt, ca.key): used when there, "
                        "made there when not (default: --out)")  # fmt: skip
    parser.add_argument("--tls-only", action="store_true", help="only the TLS Secrets (renewing the certificates)")
    parser.add_argument("--namespace", default="specdec")
    parser.add_argument("--client", action="append", help="an API key's name (repeatable; default: one 'default')")
    parser.add_argument("--redis-url", default="", help="a managed Redis (rediss://:PASSWORD@HOST:PORT/DB)")
    parser.add_argument("--cluster-domain", default="cluster.local")
    parser.add_argument("--days", type=int, default=365, help="validity of the certificates (a new CA: 5x)")
    args = parser.parse_args(argv)
    os.umask(0o077)
    ca = args.ca or args.out
    try:
        objects = make_secrets(
            ca, args.namespace, tuple(args.client or ["default"]), args.redis_url, args.cluster_domain, args.days,
            args.tls_only,
        )  # fmt: skip
    except (ValueError, RuntimeError) as error:
        print(f"k8s_secrets: {error}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "secrets.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=1))
    print(f"wrote {args.out}/secrets.json (apply it: kubectl apply -f {args.out}/secrets.json); the CA is in {ca}")
    for name in [] if args.tls_only else args.client or ["default"]:
        path = name.replace(".", "\\.")  # jsonpath escapes dots in a key
        print(
            f"API key {name!r}: kubectl -n {args.namespace} get secret specdec-api-keys "
            f"-o jsonpath='{{.data.{path}}}' | base64 -d"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
