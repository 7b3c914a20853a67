"""API keys for the client-facing API, stored hashed (SHA-256) in Redis, and the admin command line.

    python -m coordinator.api_keys add NAME --requests-per-minute 60 --tokens-per-minute 20000
    python -m coordinator.api_keys add NAME --key-file /etc/specdec/api-keys/NAME
    python -m coordinator.api_keys revoke NAME
    python -m coordinator.api_keys list

`add` prints the new key once; only its SHA-256 is stored. With `--key-file` it stores the key that file holds
(made elsewhere, e.g. a Kubernetes Secret) and prints nothing of it; adding the same key to the same name again
only sets its limits, so a seeding job can run again. Clients send it as `authorization: Bearer KEY`
metadata (`specdec.client.Client(address, api_key=KEY)`). The Redis URL comes from `--redis-url` or
SPECDEC_REDIS_URL, the key prefix from `--redis-key-prefix` or SPECDEC_REDIS_KEY_PREFIX (as the coordinator's).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
import time
from dataclasses import dataclass

import redis
import redis.asyncio

from coordinator.redis_state import RedisKeys, connect_sync

KEY_PREFIX = "sd-"
MIN_GIVEN_KEY_CHARS = 24  # a key made elsewhere: at least ~128 bits when random URL-safe characters


def hash_key(key: str) -> str:
    """The SHA-256 (hex) under which a key is stored; the key itself never is."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """A key's owner and limits (0 = unlimited); key_id is the stored hash."""

    key_id: str
    name: str
    requests_per_minute: int
    tokens_per_minute: int

    @classmethod
    def from_hash(cls, key_id: str, fields: dict[bytes, bytes]) -> ApiKey:
        return cls(
            key_id=key_id,
            name=fields[b"name"].decode(),
            requests_per_minute=int(fields.get(b"requests_per_minute", b"0")),
            tokens_per_minute=int(fields.get(b"tokens_per_minute", b"0")),
        )


class ApiKeyStore:
    """Looks keys up (asyncio, on every call: a revoked key stops working at once)."""

    def __init__(self, client: redis.asyncio.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    async def lookup(self, key: str) -> ApiKey | None:
        """The key's record, or None when it is unknown or revoked. Redis errors propagate."""
        key_id = hash_key(key)
        fields = await self.client.hgetall(self.keys.api_key(key_id))
        return ApiKey.from_hash(key_id, fields) if fields else None


def add_key(
    client: redis.Redis, keys: RedisKeys, name: str, requests_per_minute: int = 0, tokens_per_minute: int = 0
) -> str:
    """Creates a key for `name` (which must be new) and returns it; only its hash is stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    store_key(client, keys, name, key, requests_per_minute, tokens_per_minute, replace_limits=False)
    return key


def store_key(
    client: redis.Redis,
    keys: RedisKeys,
    name: str,
    key: str,
    requests_per_minute: int = 0,
    tokens_per_minute: int = 0,
    replace_limits: bool = True,
) -> bool:
    """Stores the hash of `key` for `name`; True when stored, False when `name` already had this very key (its
    limits are then set anew if replace_limits, else ValueError). Another key of `name` is a ValueError."""
    if not name or any(c.isspace() for c in name):
        raise ValueError("name: must be non-empty without whitespace")
    if requests_per_minute < 0 or tokens_per_minute < 0:
        raise ValueError("limits must be >= 0 (0 = unlimited)")
    key_id = hash_key(key)
    limits = {"requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute}
    if not client.hsetnx(keys.api_key_names(), name, key_id):
        if not replace_limits or client.hget(keys.api_key_names(), name) != key_id.encode():
            raise ValueError(f"name: {name!r} already has a key (revoke it first)")
        client.hset(keys.api_key(key_id), mapping=limits)
        return False
    client.hset(keys.api_key(key_id), mapping={"name": name, **limits, "created": int(time.time())})
    return True


def read_key_file(path: str) -> str:
    """The key a file holds (surrounding whitespace dropped), or ValueError."""
    try:
        with open(path, encoding="utf-8") as file:
            key = file.read().strip()
    except OSError as error:
        raise ValueError(f"--key-file: cannot read {path!r}: {error.strerror}") from None
    if len(key) < MIN_GIVEN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(f"--key-file: {path!r} must hold one key of at least {MIN_GIVEN_KEY_CHARS} characters")
    return key


def revoke_key(client: redis.Redis, keys: RedisKeys, name: str) -> bool:
    """Deletes the key of `name`; False when there was none."""
    key_id = client.hget(keys.api_key_names(), name)
    if key_id is None:
        return False
    pipe = client.pipeline()
    pipe.delete(
        keys.api_key(key_id.decode()), keys.rate(key_id.decode(), "requests"), keys.rate(key_id.decode(), "tokens")
    )
    pipe.hdel(keys.api_key_names(), name)
    pipe.execute()
    return True


def list_keys(client: redis.Redis, keys: RedisKeys) -> list[ApiKey]:
    records = []
    for _, key_id in sorted(client.hgetall(keys.api_key_names()).items()):
        fields = client.hgetall(keys.api_key(key_id.decode()))
        if fields:
            records.append(ApiKey.from_hash(key_id.decode(), fields))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.api_keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", ""))
    parser.add_argument("--redis-key-prefix", default=os.environ.get("SPECDEC_REDIS_KEY_PREFIX", "specdec:"))
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="create a key and print it (once)")
    add.add_argument("name")
    add.add_argument("--requests-per-minute", type=int, default=0, help="0 = unlimited")
    add.add_argument(
        "--tokens-per-minute", type=int, default=0, help="prompt + generated tokens per minute; 0 = unlimited"
    )
    add.add_argument(
        "--key-file",
        help="store the key this file holds instead of making one (prints nothing; the same key "
        "for the same name again only sets its limits)",
    )
    revoke = commands.add_parser("revoke", help="delete a key at once")
    revoke.add_argument("name")
    commands.add_parser("list", help="names and limits (never the keys)")
    args = parser.parse_args(argv)
    if not args.redis_url:
        parser.error("give --redis-url or set SPECDEC_REDIS_URL")
    client, keys = connect_sync(args.redis_url), RedisKeys(args.redis_key_prefix)
    try:
        if args.command == "add" and args.key_file:
            key = read_key_file(args.key_file)
            stored = store_key(client, keys, args.name, key, args.requests_per_minute, args.tokens_per_minute)
            print(f"{args.name}: {'stored' if stored else 'already stored, limits set'}")
        elif args.command == "add":
            print(add_key(client, keys, args.name, args.requests_per_minute, args.tokens_per_minute))
        elif args.command == "revoke":
            if not revoke_key(client, keys, args.name):
                print(f"no key named {args.name!r}", file=sys.stderr)
                return 1
        else:
            for record in list_keys(client, keys):
                print(
                    f"{record.name}\trequests/min={record.requests_per_minute or 'unlimited'}\t"
                    f"tokens/min={record.tokens_per_minute or 'unlimited'}"
                )
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
