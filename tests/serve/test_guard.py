"""The guard alone (no Ray, no HTTP): API keys, the per-key rate bucket and requests in flight,
with a fake clock. ``test_security.py`` checks the same rules over HTTP."""

from __future__ import annotations

import os

import pytest
from specserve.app_config import AuthConfig, LimitsConfig
from specserve.errors import ConfigError
from specserve.serve.guard import ANONYMOUS, Guard, KeyRing, Lease, Refusal, TokenBucket, key_id

KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def guard(limits: dict | None = None, env: dict | None = None, **auth) -> Guard:
    return Guard(AuthConfig(**auth), LimitsConfig(**(limits or {})),
                 environ=env if env is not None else {"SPECSERVE_API_KEYS": f"{KEY_A}, {KEY_B}"},
                 clock=Clock())


def test_bearer_keys_are_checked():
    g = guard()
    assert g.authenticate(f"Bearer {KEY_A}") == key_id(KEY_A)
    assert g.authenticate(f"bearer {KEY_B}") == key_id(KEY_B)
    for header, code in ((None, "missing_api_key"), ("", "missing_api_key"),
                         ("Basic abc", "missing_api_key"), ("Bearer ", "missing_api_key"),
                         ("Bearer sk-alpha-012345678", "invalid_api_key"),  # a prefix is not a key
                         (f"Bearer {KEY_A}x", "invalid_api_key")):
        refusal = g.authenticate(header)
        assert isinstance(refusal, Refusal) and refusal.status == 401 and refusal.code == code, header
    assert g.refused == {"401:missing_api_key": 4, "401:invalid_api_key": 2}


def test_key_ids_name_keys_without_revealing_them():
    kid = key_id(KEY_A)
    assert kid.startswith("key-") and len(kid) == 12 and KEY_A not in kid and kid != key_id(KEY_B)


def test_auth_off_means_one_anonymous_key():
    g = guard(enabled=False, env={})
    assert g.keys is None and g.authenticate(None) == ANONYMOUS == g.authenticate("Bearer junk")


def test_auth_on_without_keys_refuses_to_start():
    with pytest.raises(ConfigError, match="no API keys.*auth.enabled: false"):
        guard(env={})
    with pytest.raises(ConfigError, match="shorter than 8"):
        guard(env={"SPECSERVE_API_KEYS": "short"})
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        guard(env={"SPECSERVE_API_KEYS_FILE": "/nonexistent/keys"})


def test_key_file_is_read_and_reloaded_when_it_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# rotated monthly\n{KEY_A}\n\n")
    clock = Clock()
    ring = KeyRing(AuthConfig(api_keys_file=str(path)), environ={}, clock=clock)
    assert len(ring) == 1 and ring.match(KEY_A) and ring.match(KEY_B) is None
    path.write_text(f"{KEY_B}\n")
    os.utime(path, (1, 1))  # a different mtime, however fast the file system's clock is
    assert ring.match(KEY_A)  # re-read at most every few seconds
    clock.t += 10
    assert ring.match(KEY_B) == key_id(KEY_B) and ring.match(KEY_A) is None
    path.unlink()  # a Secret being swapped: keep the old keys meanwhile
    clock.t += 10
    assert ring.match(KEY_B)


def test_env_file_variable_names_the_key_file(tmp_path):
    path = tmp_path / "k"
    path.write_text(KEY_B)
    ring = KeyRing(AuthConfig(), environ={"SPECSERVE_API_KEYS_FILE": str(path),
                                          "SPECSERVE_API_KEYS": KEY_A})
    assert ring.match(KEY_A) and ring.match(KEY_B) and len(ring) == 2


def test_rate_limit_bucket_refuses_with_the_wait_and_refills():
    g = guard({"requests_per_minute": 60, "burst": 3})
    kid = key_id(KEY_A)
    leases = [g.admit(kid) for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in leases)
    refusal = g.admit(kid)
    assert isinstance(refusal, Refusal) and refusal.status == 429
    assert refusal.code == "rate_limit_exceeded" and refusal.retry_after_s == 1
    assert isinstance(g.admit(key_id(KEY_B)), Lease)  # the other key has its own bucket
    g.clock.t += 1.0  # one request per second comes back
    assert isinstance(g.admit(kid), Lease) and isinstance(g.admit(kid), Refusal)


def test_token_bucket_wait_is_exact():
    bucket = TokenBucket(rate_per_s=0.5, capacity=1, now=0.0)
    assert bucket.take(0.0) == 0.0
    assert bucket.take(0.5) == pytest.approx(1.5)  # 0.25 tokens back: 0.75 to go at 0.5 / s
    assert bucket.take(2.5) == 0.0


def test_concurrency_limit_counts_leases_until_released():
    g = guard({"max_concurrent_requests": 2})
    kid = key_id(KEY_A)
    first, second = g.admit(kid), g.admit(kid)
    refusal = g.admit(kid)
    assert isinstance(refusal, Refusal) and refusal.code == "concurrency_limit_exceeded"
    assert refusal.status == 429 and refusal.retry_after_s == 1
    assert g.requests_in_flight == 2
    first.release()
    first.release()  # idempotent
    assert g.requests_in_flight == 1
    third = g.admit(kid)
    assert isinstance(third, Lease)
    streamed = third.hand_over()  # a stream takes the lease over from its handler
    third.release()
    assert g.requests_in_flight == 2
    streamed.release()
    second.release()
    assert g.requests_in_flight == 0 and g.in_flight == {}


def test_a_request_refused_for_concurrency_spends_no_rate_token():
    """Checked in that order: a client retrying while its streams run must not drain its own
    rate budget with requests that were never admitted."""
    g = guard({"requests_per_minute": 60, "burst": 2, "max_concurrent_requests": 1})
    kid = key_id(KEY_A)
    running = g.admit(kid)
    assert isinstance(running, Lease)
    for _ in range(5):
        refusal = g.admit(kid)
        assert isinstance(refusal, Refusal) and refusal.code == "concurrency_limit_exceeded"
    running.release()
    assert isinstance(g.admit(kid), Lease)  # the second token of the burst is still there
    assert g.refused == {"429:concurrency_limit_exceeded": 5}
