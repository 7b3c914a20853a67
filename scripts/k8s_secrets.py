"""Make the Secrets the Kubernetes manifests read (k8s/README.md, "Deploy"), with fresh values.

    python3 scripts/k8s_secrets.py --out ~/specdec-secrets [--namespace specdec] [--client NAME ...]
    kubectl apply -f ~/specdec-secrets/secrets.json

Writes `secrets.json` (a v1 List, for `kubectl apply -f`) holding
  specdec-redis     password (the bundled Redis's), url (what the coordinator and the key-seeding Job use;
                    --redis-url points them at a managed Redis instead)
  specdec-api-keys  one key per client name (--client, repeatable); the seeding Job stores their hashes in Redis
  specdec-tls       tls.crt / tls.key: one certificate for every service, valid as server and client (mutual TLS
                    between the services), for each Service's DNS names, `localhost` (port-forwarding), and
                    REPLICA_SERVER_NAME, the name the coordinator checks draft and verify pods against (it dials
                    their pod IPs); ca.crt: the CA that signed it, which every service trusts for client
                    certificates and clients use to check the coordinator
and beside it `ca.crt` for clients and `ca.key` (0600) to sign more certificates; keep that one offline.
Needs Python 3.9+ and the openssl command line; the manifests never hold these values, so `kubectl apply -k`
cannot overwrite them. A certificate from your own CA (cert-manager, a corporate PKI) works as well as long as
it has these names and both extended key usages.
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
    "specdec-api-keys": (),
}
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


def make_certificates(directory: pathlib.Path, names: list[str], days: int) -> dict[str, bytes]:
    """A CA and one certificate for `names` (server and client use) it signed: {tls.crt, tls.key, ca.crt, ca.key}."""
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt, ext = (directory / f"tls.{suffix}" for suffix in ("key", "csr", "crt", "ext"))
    openssl("req", "-x509", *EC_KEY, "-keyout", str(ca_key), "-out", str(ca_crt), "-days", str(days * 5),
            "-subj", "/CN=specdec CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    ext.write_text(
        f"subjectAltName={','.join('DNS:' + n for n in names)},IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n"
    )
    openssl("req", *EC_KEY, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=specdec")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(crt), "-days", str(days), "-extfile", str(ext))  # fmt: skip
    return {name: (directory / name).read_bytes() for name in ("tls.crt", "tls.key", "ca.crt", "ca.key")}


def secret(name: str, namespace: str, data: dict[str, bytes], kind: str = "Opaque") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "specdec"}},
        "type": kind,
        "data": {key: base64.b64encode(value).decode() for key, value in data.items()},
    }


def make_secrets(
    namespace: str = "specdec",
    clients: tuple[str, ...] = ("default",),
    redis_url: str = "",
    cluster_domain: str = "cluster.local",
    days: int = 365,
) -> tuple[list[dict], dict[str, bytes]]:
    """(the three Secrets, the PEM files of the TLS material including ca.key)."""
    bad = [name for name in clients if not CLIENT_NAME.match(name)]
    if bad or not clients:
        raise ValueError(f"client names must be letters, digits, '-', '_' or '.': {bad or 'none given'}")
    password = secrets.token_hex(24)
    with tempfile.TemporaryDirectory() as scratch:
        pem = make_certificates(pathlib.Path(scratch), dns_names(namespace, cluster_domain), days)
    url = redis_url or f"redis://:{password}@specdec-redis:6379/0"
    keys = {name: (API_KEY_PREFIX + secrets.token_urlsafe(32)).encode() for name in clients}
    tls = {name: pem[name] for name in SECRET_KEYS["specdec-tls"]}
    objects = [
        secret("specdec-redis", namespace, {"password": password.encode(), "url": url.encode()}),
        secret("specdec-api-keys", namespace, keys),
        secret("specdec-tls", namespace, tls, "kubernetes.io/tls"),
    ]
    return objects, pem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="directory for secrets.json, ca.crt, ca.key")
    parser.add_argument("--namespace", default="specdec")
    parser.add_argument("--client", action="append", help="an API key's name (repeatable; default: one 'default')")
    parser.add_argument("--redis-url", default="", help="a managed Redis (rediss://:PASSWORD@HOST:PORT/DB)")
    parser.add_argument("--cluster-domain", default="cluster.local")
    parser.add_argument("--days", type=int, default=365, help="validity of the service certificate (CA: 5x)")
    args = parser.parse_args(argv)
    try:
        objects, pem = make_secrets(
            args.namespace, tuple(args.client or ["default"]), args.redis_url, args.cluster_domain, args.days
        )
    except (ValueError, RuntimeError) as error:
        print(f"k8s_secrets: {error}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    os.umask(0o077)
    (args.out / "secrets.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=1))
    (args.out / "ca.crt").write_bytes(pem["ca.crt"])
    (args.out / "ca.key").write_bytes(pem["ca.key"])
    print(f"wrote {args.out}/secrets.json (apply it: kubectl apply -f {args.out}/secrets.json), ca.crt, ca.key")
    for name in args.client or ["default"]:
        path = name.replace(".", "\\.")  # jsonpath escapes dots in a key
        print(
            f"API key {name!r}: kubectl -n {args.namespace} get secret specdec-api-keys "
            f"-o jsonpath='{{.data.{path}}}' | base64 -d"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
