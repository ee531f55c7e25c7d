"""qserver.auth: the guard the client protocols ask about every request
when `<security>` is configured (no I/O: plain calls)."""

from __future__ import annotations

import hmac

import pytest

from qserver import auth
from qserver.auth import LOG_BURST, LOG_WINDOW_MS, UNAUTHORIZED, FailureLog, Guard
from qserver.config import ACTION_NAMES, ClientToken

ADMIN = ClientToken(name="admin", token="admin-secret-0123456789")
READER = ClientToken(name="reader", token="reader-secret-0123456789",
                     actions=frozenset({4, 104, 7, 107, 8}))
PRODUCER = ClientToken(name="producer", token="producer-secret-012345",
                       actions=frozenset(ACTION_NAMES["produce"]))


@pytest.fixture
def guard() -> Guard:
    return Guard([ADMIN, READER, PRODUCER])


def test_lookup(guard):
    assert guard.lookup(ADMIN.token) is ADMIN
    assert guard.lookup(READER.token) is READER
    for wrong in ("", "admin", ADMIN.token + "x", ADMIN.token[:-1], 12, None,
                  [ADMIN.token], ADMIN.token.upper()):
        assert guard.lookup(wrong) is None


def test_lookup_compares_every_token(guard, monkeypatch):
    # No early exit: the first token matching still compares the others.
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    guard.lookup(ADMIN.token)
    assert len(calls) == 3
    calls.clear()
    guard.lookup("no such token at all")
    assert len(calls) == 3


def test_guard_keeps_no_secret(guard):
    assert all(ADMIN.token not in repr(d) for d, _ in guard._entries)


def test_authenticate(guard):
    obj = {"action": 0, "token": READER.token, "seq": 7}
    token, reason = guard.authenticate(obj)
    assert token is READER and reason is None
    assert obj == {"action": 0, "seq": 7, "code": 0, "name": "reader"}


@pytest.mark.parametrize("presented,words", [("wrong-secret-0123456789", "unknown token"),
                                             (None, "needs a token"),
                                             (123, "must be a string")])
def test_authenticate_refused(guard, presented, words):
    obj = {"action": 0, "seq": 1}
    if presented is not None:
        obj["token"] = presented
    token, reason = guard.authenticate(obj)
    assert token is None and reason is not None and words in reason
    assert obj == {"action": 0, "seq": 1, "code": -1, "reason": reason}
    assert reason.startswith(UNAUTHORIZED)


def test_authorize_by_connection(guard):
    obj = {"action": 4, "queue": "q"}
    assert guard.authorize(obj, READER) is None
    assert obj == {"action": 4, "queue": "q"}


def test_authorize_without_token(guard):
    obj = {"action": 1, "queue": "q", "data": "x", "seq": 3}
    reason = guard.authorize(obj, None)
    assert reason is not None and reason.startswith(UNAUTHORIZED)
    assert obj == {"action": 1, "queue": "q", "seq": 3, "code": -1, "reason": reason}


def test_authorize_not_allowed(guard):
    obj = {"action": 1, "queue": "q", "data": "x"}
    reason = guard.authorize(obj, READER)
    assert reason == "unauthorized: token 'reader' is not allowed action 1 (produce)"
    assert obj["code"] == -1 and "data" not in obj
    # an unknown action fails closed, even for a token allowed everything
    for action in (99, "1", None, True):
        obj = {"action": action}
        reason = guard.authorize(obj, ADMIN)
        assert reason is not None and reason.startswith(UNAUTHORIZED), action


def test_authorize_by_field(guard):
    # The field is taken out (never echoed, never forwarded) and decides
    # alone, even on a connection authenticated otherwise.
    obj = {"action": 1, "queue": "q", "data": "x", "token": PRODUCER.token}
    assert guard.authorize(obj, None) is None
    assert "token" not in obj
    obj = {"action": 4, "token": PRODUCER.token}
    assert guard.authorize(obj, ADMIN) is not None and "token" not in obj
    obj = {"action": 4, "token": "wrong-secret-0123456789"}
    assert guard.authorize(obj, ADMIN) == "unauthorized: unknown token"
    assert "token" not in obj and obj["code"] == -1


def test_guard_needs_a_token():
    with pytest.raises(ValueError):
        Guard([])


def test_failure_log_rate_limit():
    log = FailureLog()
    t = 1_000_000
    assert [log.note(t + i) for i in range(LOG_BURST)] == [0] * LOG_BURST
    assert [log.note(t + 10 + i) for i in range(7)] == [None] * 7
    # a new window: logged again, saying how many were held back
    assert log.note(t + LOG_WINDOW_MS) == 7
    assert log.note(t + LOG_WINDOW_MS + 1) == 0
