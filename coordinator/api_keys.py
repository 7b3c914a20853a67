"""API keys for the client-facing API, stored hashed (SHA-256) in Redis, and the admin command line.

    python -m coordinator.api_keys add NAME --requests-per-minute 60 --tokens-per-minute 20000
    python -m coordinator.api_keys revoke NAME
    python -m coordinator.api_keys list

`add` prints the new key once; only its SHA-256 is stored. Clients send it as `authorization: Bearer KEY`
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
    if not name or any(c.isspace() for c in name):
        raise ValueError("name: must be non-empty without whitespace")
    if requests_per_minute < 0 or tokens_per_minute < 0:
        raise ValueError("limits must be >= 0 (0 = unlimited)")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = hash_key(key)
    if not client.hsetnx(keys.api_key_names(), name, key_id):
        raise ValueError(f"name: {name!r} already has a key (revoke it first)")
    client.hset(
        keys.api_key(key_id),
        mapping={
            "name": name,
            "requests_per_minute": requests_per_minute,
            "tokens_per_minute": tokens_per_minute,
            "created": int(time.time()),
        },
    )
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
    revoke = commands.add_parser("revoke", help="delete a key at once")
    revoke.add_argument("name")
    commands.add_parser("list", help="names and limits (never the keys)")
    args = parser.parse_args(argv)
    if not args.redis_url:
        parser.error("give --redis-url or set SPECDEC_REDIS_URL")
    client, keys = connect_sync(args.redis_url), RedisKeys(args.redis_key_prefix)
    try:
        if args.command == "add":
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
