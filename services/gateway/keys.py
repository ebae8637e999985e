"""API keys as identities: who is calling, and with which per-key limits.

A key is `sk-specd-` + secrets.token_urlsafe(32), shown once when created; only its SHA-256
hex digest is stored, with a record {name, created, limits}. A request is identified by the
digest of the key it presents: a hash-table lookup of a digest, so no stored secret is ever
compared byte by byte with what a client sent (no timing side channel to guard with
hmac.compare_digest).

Two stores with one interface (KeyStore):

- RedisKeyStore, shared by every gateway replica on the same URL and namespace:

      {namespace}:v1:api-keys       hash  digest -> record JSON
      {namespace}:v1:api-key-names  hash  name -> digest (names are unique)

  create and revoke are one Lua script each, so both hashes change together.
- FileKeyStore, one JSON file {"version": 1, "keys": {digest: record}}, re-read whenever its
  inode, mtime or size changes; written atomically (temporary file in the same directory,
  mode 0600, fsync, os.replace) under an exclusive lock on `<file>.lock`.

KeyRing is what the gateway asks: the legacy static keys (the `api_keys` setting, hashed at
start, named key-1, key-2, ..., unlimited) first, then the store through a cache of known keys.
A cached key is trusted for LOOKUP_TTL_S, so a revocation reaches every replica within that
time; an unknown digest is remembered as unknown for NEGATIVE_TTL_S, so a client repeating a
wrong key costs the store one lookup per NEGATIVE_TTL_S, not one per request (both caches are
LRUs of bounded size). When the store is unreachable a key looked up successfully within
OUTAGE_GRACE_S is still accepted (a brief Redis outage does not refuse known keys) and any
other key is refused with Unavailable (503: the key may be valid, the gateway cannot tell).
A circuit breaker (services.common.breaker) skips the store for BREAKER_COOLDOWN_S after a
failure, so a hung Redis costs one lookup timeout per cool-down, not one per request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.breaker import Breaker
from services.common.state import REDIS_ERRORS, redact_url, redis_client
from specd.errors import SpecdError, Unavailable

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-specd-"
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
LOOKUP_TTL_S = 0.5  # a cached key is trusted this long: the bound on a revocation's delay
OUTAGE_GRACE_S = 60.0  # store unreachable: keys known this recently are still accepted
MAX_CACHED = 10_000  # known keys kept in one gateway's cache (least recently used dropped)
NEGATIVE_TTL_S = 2.0  # an unknown digest is answered from the cache this long
MAX_UNKNOWN = 10_000  # unknown digests kept (least recently used dropped)
BREAKER_COOLDOWN_S = 2.0  # after a failed lookup, the store is skipped this long (then one probe)


class CorruptRecord(Unavailable):
    """One key's record cannot be read: that key is refused (503), the store itself is fine."""


class Limits(BaseModel):
    """Per-key limits; 0 means unlimited."""

    model_config = ConfigDict(frozen=True)

    requests_per_minute: int = Field(0, ge=0, description="generation requests per minute")
    tokens_per_minute: int = Field(0, ge=0, description="prompt and completion tokens per minute "
                                                        "(max_tokens is charged at admission, then settled "
                                                        "to the tokens used)")
    concurrent_requests: int = Field(0, ge=0, description="generations in flight at once")

    @property
    def unlimited(self) -> bool:
        return not (self.requests_per_minute or self.tokens_per_minute or self.concurrent_requests)


UNLIMITED = Limits()


class KeyRecord(BaseModel):
    """What is stored for a key (never the key itself)."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    created: int = Field(description="unix time")
    limits: Limits = UNLIMITED


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    """The SHA-256 hex digest of a presented key: what the stores keep and look up."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def static_records(keys: Iterable[str]) -> dict[str, KeyRecord]:
    """digest -> record of the legacy plaintext keys: key-1, key-2, ... in order, unlimited."""
    now = int(time.time())
    return {digest(k): KeyRecord(name=f"key-{i}", created=now) for i, k in enumerate(keys, 1)}


def _check_name(name: str) -> None:
    try:
        KeyRecord(name=name, created=0)
    except ValidationError:
        raise SpecdError(f"invalid key name {name!r}: 1 to 64 of A-Z a-z 0-9 _ . -") from None


class KeyStore(Protocol):
    async def lookup(self, key_digest: str) -> KeyRecord | None:
        """The record of a digest, or None; Unavailable when the store cannot be read."""

    async def create(self, name: str, limits: Limits) -> str:
        """A new key named `name` (SpecdError if the name is taken); returns the key itself."""

    async def revoke(self, name: str) -> bool:
        """Delete the key named `name`; False when there is none."""

    async def records(self) -> list[KeyRecord]:
        """Every record, by name."""

    async def count(self) -> int:
        """How many keys the store holds."""

    async def close(self) -> None:
        """Release connections."""


# -- Redis ------------------------------------------------------------------------------------

_CREATE = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""
_REVOKE = """
local d = redis.call('HGET', KEYS[2], ARGV[1])
if not d then return 0 end
redis.call('HDEL', KEYS[1], d)
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""


class RedisKeyStore:
    def __init__(self, url: str, namespace: str = "specd", *, timeout_s: float = 1.0) -> None:
        self.url = url
        self.keys_key = f"{namespace}:v1:api-keys"
        self.names_key = f"{namespace}:v1:api-key-names"
        self._safe_url = redact_url(url)
        self._redis = redis_client(url, timeout_s)
        self._create = self._redis.register_script(_CREATE)
        self._revoke = self._redis.register_script(_REVOKE)

    def _unavailable(self, e: Exception) -> Unavailable:
        return Unavailable(f"API keys: Redis at {self._safe_url} is unreachable: {type(e).__name__}: {e}")

    async def lookup(self, key_digest: str) -> KeyRecord | None:
        try:
            raw = await self._redis.hget(self.keys_key, key_digest)
        except REDIS_ERRORS as e:
            raise self._unavailable(e) from e
        if raw is None:
            return None
        try:
            return KeyRecord.model_validate_json(raw)
        except ValidationError as e:  # the store's data, not the client's: a 503, logged, never a 500
            log.error("API keys: the record under %s in %s is corrupt: %s", key_digest[:12], self.keys_key, e)
            raise CorruptRecord("API keys: a key record cannot be read") from None

    async def create(self, name: str, limits: Limits) -> str:
        _check_name(name)
        key = new_key()
        record = KeyRecord(name=name, created=int(time.time()), limits=limits)
        try:
            made = await self._create(keys=[self.keys_key, self.names_key],
                                      args=[name, digest(key), record.model_dump_json()])
        except REDIS_ERRORS as e:
            raise self._unavailable(e) from e
        if not made:
            raise SpecdError(f"a key named {name!r} exists; revoke it first or choose another name")
        return key

    async def revoke(self, name: str) -> bool:
        try:
            return bool(await self._revoke(keys=[self.keys_key, self.names_key], args=[name]))
        except REDIS_ERRORS as e:
            raise self._unavailable(e) from e

    async def records(self) -> list[KeyRecord]:
        try:
            raw = await self._redis.hvals(self.keys_key)
        except REDIS_ERRORS as e:
            raise self._unavailable(e) from e
        return sorted((KeyRecord.model_validate_json(r) for r in raw), key=lambda r: r.name)

    async def count(self) -> int:
        try:
            return await self._redis.hlen(self.keys_key)
        except REDIS_ERRORS as e:
            raise self._unavailable(e) from e

    async def close(self) -> None:
        await self._redis.aclose()


# -- a JSON file ------------------------------------------------------------------------------

class FileKeyStore:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._signature: tuple[int, int, int] | None = None
        self._records: dict[str, KeyRecord] = {}

    def _read(self) -> dict[str, KeyRecord]:
        """The file's records, parsed again only when the file changed."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._signature, self._records = None, {}
            return self._records
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature != self._signature:
            try:
                doc = json.loads(self.path.read_text())
                records = {d: KeyRecord.model_validate(r) for d, r in doc["keys"].items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise Unavailable(f"API keys file {self.path} cannot be read: {type(e).__name__}: {e}") from e
            self._signature, self._records = signature, records
        return self._records

    def _write(self, records: dict[str, KeyRecord]) -> None:
        doc = {"version": 1, "keys": {d: r.model_dump() for d, r in records.items()}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self):
        """An exclusive lock on `<file>.lock`, so that two writers do not lose each other's keys."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    async def lookup(self, key_digest: str) -> KeyRecord | None:
        return self._read().get(key_digest)

    async def create(self, name: str, limits: Limits) -> str:
        _check_name(name)
        key = new_key()
        with self._locked():
            records = dict(self._read())
            if any(r.name == name for r in records.values()):
                raise SpecdError(f"a key named {name!r} exists; revoke it first or choose another name")
            records[digest(key)] = KeyRecord(name=name, created=int(time.time()), limits=limits)
            self._write(records)
        return key

    async def revoke(self, name: str) -> bool:
        with self._locked():
            records = self._read()
            kept = {d: r for d, r in records.items() if r.name != name}
            if len(kept) == len(records):
                return False
            self._write(kept)
        return True

    async def records(self) -> list[KeyRecord]:
        return sorted(self._read().values(), key=lambda r: r.name)

    async def count(self) -> int:
        return len(self._read())

    async def close(self) -> None:
        pass


def build_key_store(redis_url: str | None, keys_file: Path | None,
                    namespace: str = "specd") -> KeyStore | None:
    """The keys file when given, else Redis when a URL is given, else none."""
    if keys_file:
        return FileKeyStore(keys_file)
    if redis_url:
        return RedisKeyStore(redis_url, namespace)
    return None


# -- what the gateway asks --------------------------------------------------------------------

class KeyRing:
    """The gateway's identities: static keys, then the store through short caches and a breaker."""

    def __init__(self, store: KeyStore | None = None, static_keys: Iterable[str] = (), *,
                 cooldown_s: float = BREAKER_COOLDOWN_S) -> None:
        self.store = store
        self.static = static_records(static_keys)
        self._known: OrderedDict[str, tuple[KeyRecord, float]] = OrderedDict()  # digest -> (record, fetched)
        self._unknown: OrderedDict[str, float] = OrderedDict()  # digest -> when the store said unknown
        self.breaker = Breaker(cooldown_s)
        self.on_store_error: Callable[[], None] = lambda: None  # counts each failed lookup (metrics)
        self._warned_at = float("-inf")

    async def count(self) -> int:
        """Keys that can authenticate (static and stored); Unavailable if the store is unreachable."""
        return len(self.static) + (await self.store.count() if self.store is not None else 0)

    async def identify(self, key: str) -> KeyRecord | None:
        """The record of a presented key, None for an unknown one; Unavailable when the store is
        unreachable (or skipped by the breaker) and the key was not known within OUTAGE_GRACE_S."""
        d = digest(key)
        if d in self.static:
            return self.static[d]
        if self.store is None:
            return None
        now = time.monotonic()
        cached = self._known.get(d)
        if cached is not None and now - cached[1] < LOOKUP_TTL_S:
            self._known.move_to_end(d)
            return cached[0]
        unknown_at = self._unknown.get(d)
        if unknown_at is not None and now - unknown_at < NEGATIVE_TTL_S:
            return None
        if not self.breaker.allow():
            return self._outage(d, cached, now, Unavailable("API keys: the key store is skipped after a failure"))
        try:
            record = await self.store.lookup(d)
        except CorruptRecord:
            self.breaker.success()  # the store answered: only this record is bad
            raise
        except Unavailable as e:
            self.breaker.failure()
            self.on_store_error()
            return self._outage(d, cached, now, e)
        self.breaker.success()
        if record is None:
            self._known.pop(d, None)
            self._unknown[d] = now
            self._unknown.move_to_end(d)
            if len(self._unknown) > MAX_UNKNOWN:
                self._unknown.popitem(last=False)
            return None
        self._unknown.pop(d, None)
        self._known[d] = (record, now)
        self._known.move_to_end(d)
        if len(self._known) > MAX_CACHED:
            self._known.popitem(last=False)
        return record

    def _outage(self, d: str, cached: tuple[KeyRecord, float] | None, now: float, error: Unavailable) -> KeyRecord:
        """The store cannot answer: the cached record if it is recent enough, else `error`."""
        if cached is not None and now - cached[1] < OUTAGE_GRACE_S:
            if now - self._warned_at >= 10:
                self._warned_at = now
                log.warning("API key store unreachable: accepting keys known within %.0f s", OUTAGE_GRACE_S)
            return cached[0]
        raise error

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

