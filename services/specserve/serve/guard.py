"""Who may call the API and how much: API keys, per-key request rate and requests in flight.

Pure Python, no Ray and no FastAPI: the ingress asks :class:`Guard` once per request and gets
either a :class:`Lease` (give it back when the response has ended) or a :class:`Refusal` with
the HTTP status, the OpenAI error and, for 429, the seconds to wait.

Keys are never stored or logged as text beyond the set loaded from the file or environment;
what the rest of the service sees is a key id, ``key-`` and the first 8 hex digits of the
key's SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

from specserve.app_config import AuthConfig, LimitsConfig
from specserve.errors import ConfigError

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"   # the key id of every request when auth is off
KEYS_FILE_ENV = "SPECSERVE_API_KEYS_FILE"
RELOAD_CHECK_S = 5.0      # how often the key file's mtime is looked at
MIN_KEY_LENGTH = 8


def key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    type: str
    code: str
    retry_after_s: int | None = None


class KeyRing:
    """The accepted keys, from a file and / or an environment variable, as SHA-256 digests.

    :meth:`match` hashes the presented key and compares it with *every* stored digest with
    ``hmac.compare_digest`` (no early exit), so the time taken says nothing about how close
    a guess was. The file is re-read when its mtime changes (checked every few seconds)."""

    def __init__(self, cfg: AuthConfig, environ: dict | None = None, clock=time.monotonic) -> None:
        env = os.environ if environ is None else environ
        self.path = cfg.api_keys_file or env.get(KEYS_FILE_ENV) or None
        self.env_name = cfg.api_keys_env
        self.env_keys = _split(env.get(cfg.api_keys_env, ""), ",")
        self.clock = clock
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._checked = -math.inf
        self._digests: list[tuple[bytes, str]] = []
        self._load(initial=True)

    def __len__(self) -> int:
        return len(self._digests)

    def _load(self, initial: bool = False) -> None:
        keys = list(self.env_keys)
        if self.path:
            try:
                self._mtime = os.stat(self.path).st_mtime
                with open(self.path, encoding="utf-8") as f:
                    keys += [line.strip() for line in f
                             if line.strip() and not line.lstrip().startswith("#")]
            except (OSError, UnicodeDecodeError) as exc:
                if initial:
                    raise ConfigError(f"auth: cannot read the API key file {self.path}: {exc}") from exc
                log.error("auth: cannot re-read the API key file %s (%s); keeping the old keys",
                          self.path, type(exc).__name__)
                return
        short = [k for k in keys if len(k) < MIN_KEY_LENGTH]
        if short:
            raise ConfigError(f"auth: {len(short)} API key(s) shorter than {MIN_KEY_LENGTH} characters")
        if not keys and initial:
            raise ConfigError(
                f"auth is enabled but there are no API keys: put them in a file named by "
                f"auth.api_keys_file or ${KEYS_FILE_ENV} (one per line), or in ${self.env_name} "
                f"(comma-separated); or set auth.enabled: false to serve without keys")
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in dict.fromkeys(keys)]
        if not initial:
            log.info("auth: reloaded %d API key(s) from %s", len(self._digests), self.path)

    def maybe_reload(self) -> None:
        if not self.path or self.clock() - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            self._checked = self.clock()
            try:
                mtime = os.stat(self.path).st_mtime
            except OSError:
                return  # a Secret being swapped; keep the old keys until the file is back
            if mtime != self._mtime:
                try:
                    self._load()
                except ConfigError as exc:
                    log.error("%s; keeping the old keys", exc)

    def match(self, presented: str) -> str | None:
        """The key id of ``presented`` if it is a known key, else None."""
        self.maybe_reload()
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for stored, kid in self._digests:
            if hmac.compare_digest(stored, digest):
                found = kid
        return found


class TokenBucket:
    """``rate`` tokens per second up to ``capacity``; :meth:`take` -> 0 or seconds to wait."""

    def __init__(self, rate_per_s: float, capacity: int, now: float) -> None:
        self.rate, self.capacity = rate_per_s, capacity
        self.tokens, self.stamp = float(capacity), now

    def take(self, now: float) -> float:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass
class Lease:
    """One admitted request; :meth:`release` (idempotent) when its response has ended."""

    key_id: str
    _guard: Guard | None = field(default=None, repr=False)

    def release(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard._release(self.key_id)

    def hand_over(self) -> Lease:
        """A new lease holding this one's place; this one's :meth:`release` becomes a no-op
        (a streamed response owns the request beyond the handler that admitted it)."""
        guard, self._guard = self._guard, None
        return Lease(self.key_id, guard)


class Guard:
    """Authentication, then the key's requests in flight, then its request rate."""

    def __init__(self, auth: AuthConfig, limits: LimitsConfig, *, environ: dict | None = None,
                 clock=time.monotonic) -> None:
        self.auth, self.limits, self.clock = auth, limits, clock
        self.keys = KeyRing(auth, environ, clock) if auth.enabled else None
        self._buckets: dict[str, TokenBucket] = {}
        self.in_flight: dict[str, int] = {}
        self.refused: dict[str, int] = {}   # "401:invalid_api_key" -> count, since start

    def authenticate(self, authorization: str | None) -> str | Refusal:
        """The key id, or a 401. ``authorization`` is the raw ``Authorization`` header."""
        if self.keys is None:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return self._refuse(Refusal(
                401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error", "missing_api_key"))
        kid = self.keys.match(token.strip())
        if kid is None:
            return self._refuse(Refusal(401, "Incorrect API key provided.", "invalid_request_error",
                                        "invalid_api_key"))
        return kid

    def admit(self, kid: str) -> Lease | Refusal:
        """A lease for one generation request of key ``kid``, or a 429 with the wait. The
        concurrency limit is checked first: a request it refuses must not spend a rate token."""
        lim = self.limits
        running = self.in_flight.get(kid, 0)
        if lim.max_concurrent_requests is not None and running >= lim.max_concurrent_requests:
            return self._refuse(Refusal(
                429, f"Too many requests in flight for this key (at most "
                     f"{lim.max_concurrent_requests}). Retry when one has finished.",
                "rate_limit_error", "concurrency_limit_exceeded", 1))
        wait = self._take_token(kid)
        if wait > 0:
            return self._refuse(Refusal(
                429, f"Rate limit reached: {lim.requests_per_minute} requests per minute for "
                     f"this key. Retry after {math.ceil(wait)} s.",
                "rate_limit_error", "rate_limit_exceeded", max(1, math.ceil(wait))))
        self.in_flight[kid] = running + 1
        return Lease(kid, self)

    def _take_token(self, kid: str) -> float:
        """0 when ``kid`` may send a request now (a token is spent), else the seconds to wait."""
        lim = self.limits
        if lim.requests_per_minute is None:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(kid)
        if bucket is None:
            bucket = self._buckets[kid] = TokenBucket(lim.requests_per_minute / 60.0,
                                                      lim.burst or lim.requests_per_minute, now)
        return bucket.take(now)

    def _release(self, kid: str) -> None:
        left = self.in_flight.get(kid, 0) - 1
        if left > 0:
            self.in_flight[kid] = left
        else:
            self.in_flight.pop(kid, None)

    def _refuse(self, refusal: Refusal) -> Refusal:
        label = f"{refusal.status}:{refusal.code}"
        self.refused[label] = self.refused.get(label, 0) + 1
        return refusal

    @property
    def requests_in_flight(self) -> int:
        return sum(self.in_flight.values())


def _split(text: str, sep: str) -> list[str]:
    return [part.strip() for part in text.split(sep) if part.strip()]
