"""Client authentication: which token a request presents, and what it may do.

Theory of operation
-------------------
With `<security>` configured (`Config.auth_required`), the client protocols
(server.py) ask a `Guard` about every decoded request before the service
sees it:

- `{"action": 0, "token": "..."}` on a TCP connection authenticates the
  connection (`Guard.authenticate`): later requests on it need no token.
  The answer is code 0 with the token's `name`; a missing or wrong token is
  code -1 "unauthorized" and leaves the connection unauthenticated (an
  earlier good action 0 no longer counts: the client asked to be someone
  else and failed).
- Any other request (`Guard.authorize`) is allowed when its own `token`
  field names a token that allows its action, or, without that field, when
  the connection's token does. A request with a `token` field is judged by
  that field alone, even on an authenticated connection. This is the only
  way over UDP, where there is no connection.
- Everything else is answered code -1 with a reason that starts with
  "unauthorized" (README, Authentication and TLS) and never reaches the service: it changes
  nothing.

The `token` field is taken out of every request (`dict.pop`) before
anything else happens: answers echo the request, and a slave forwards the
request to the master, so a token left in would travel back to the client
and on over the peer links. The master trusts a forwarded request: the
slave authenticated it, and the peer link itself is authenticated by the
cluster secret.

Constant time: a presented token is hashed (SHA-256, so every comparison is
between 32-byte strings whatever the token's length) and compared with
`hmac.compare_digest` against the digest of every configured token, with
no early exit: how long a lookup takes says nothing about which token, or
how much of one, matched.

Failed authentications are logged at WARNING by the protocols, at most
LOG_BURST per LOG_WINDOW_MS; `FailureLog` counts the ones it held back and
the next line logged says how many. No token text is ever logged.

Rules
- Action 0 needs no permission; every other action must be in the token's
  `actions` (an action no token can be given, such as an unknown number, is
  refused as not allowed: an unknown action fails closed).
- Requests that are not JSON objects, and framing errors, are not judged
  here: the service or the codec answers them with an error, which changes
  nothing either.

This module does no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from .config import ACTION_NAMES, ClientToken
from .wire.codec import error_response

__all__ = ["Guard", "FailureLog", "UNAUTHORIZED", "AUTH_ACTION", "LOG_BURST", "LOG_WINDOW_MS"]

# The reason the protocol fixes for every refusal; the words after it only
# explain (clients test `reason.startswith(UNAUTHORIZED)`).
UNAUTHORIZED = "unauthorized"
AUTH_ACTION = 0

NO_TOKEN = (f"{UNAUTHORIZED}: this node requires a client token (send "
            '{"action": 0, "token": ...} first on the connection, or a "token" field)')
BAD_TOKEN = f"{UNAUTHORIZED}: unknown token"
NOT_A_STRING = f"{UNAUTHORIZED}: token must be a string"

# Failed authentications logged per window: enough to see who is knocking,
# few enough that a client retrying in a loop (or a scan) cannot flood the
# log. The window is short so that a new problem shows up soon.
LOG_BURST = 5
LOG_WINDOW_MS = 10_000

# Action number -> its name, for the "not allowed" reason.
_ACTION_WORDS = {number: name for name, numbers in ACTION_NAMES.items() for number in numbers}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class Guard:
    """The configured client tokens, and the checks the client protocols
    make with them (see the module docstring)."""

    __slots__ = ("_entries", "failures")

    def __init__(self, tokens: Sequence[ClientToken]) -> None:
        if not tokens:
            raise ValueError("a Guard needs at least one token")
        # (SHA-256 of the secret, the token): the secret itself is not kept.
        self._entries = tuple((_digest(t.token), t) for t in tokens)
        self.failures = FailureLog()

    def lookup(self, token: object) -> ClientToken | None:
        """The configured token whose secret is `token`, or None. Compares
        against every token, in constant time (see the module docstring)."""
        if type(token) is not str:
            return None
        given = _digest(token)
        found = None
        for digest, entry in self._entries:
            if hmac.compare_digest(given, digest):  # every entry: no early exit
                found = entry
        return found

    def authenticate(self, obj: dict[str, Any]) -> tuple[ClientToken | None, str | None]:
        """Action 0: turns `obj` into its answer (its `token` field gone):
        code 0 and the token's `name`, or code -1 and the reason. Returns
        (the token, None) or (None, the reason, for the log)."""
        presented = obj.pop("token", None)
        if presented is None:
            reason = f"{UNAUTHORIZED}: action 0 needs a token field"
        else:
            found = self.lookup(presented)
            if found is not None:
                obj["code"] = 0
                obj["name"] = found.name
                return found, None
            reason = BAD_TOKEN if type(presented) is str else NOT_A_STRING
        error_response(reason, obj)
        return None, reason

    def authorize(self, obj: dict[str, Any], connection: ClientToken | None) -> str | None:
        """Any request but action 0: None if it may go on (its `token`
        field gone); else the reason, `obj` being its refusal. `connection`
        is the token the TCP connection authenticated with (None: none, or
        UDP)."""
        if "token" in obj:
            presented = obj.pop("token")
            token = self.lookup(presented)
            if token is None:
                reason = BAD_TOKEN if type(presented) is str else NOT_A_STRING
                error_response(reason, obj)
                return reason
        elif connection is None:
            error_response(NO_TOKEN, obj)
            return NO_TOKEN
        else:
            token = connection
        action = obj.get("action")
        if type(action) is int and action in token.actions:
            return None
        reason = not_allowed(token, action)
        error_response(reason, obj)
        return reason


def not_allowed(token: ClientToken, action: object) -> str:
    """The reason for an action the token does not allow, in words a user
    can act on."""
    if type(action) is int and action in _ACTION_WORDS:
        what = f"action {action} ({_ACTION_WORDS[action]})"
    else:
        what = f"action {action!r}"
    return f"{UNAUTHORIZED}: token {token.name!r} is not allowed {what}"


class FailureLog:
    """Rate limit of the failed-authentication log lines: at most LOG_BURST
    per LOG_WINDOW_MS."""

    __slots__ = ("_window_start_ms", "_logged", "_held")

    def __init__(self) -> None:
        self._window_start_ms = -LOG_WINDOW_MS  # the current window's start
        self._logged = 0  # lines logged in the current window
        self._held = 0  # failures not logged since the last line

    def note(self, now_ms: int) -> int | None:
        """A failure at `now_ms`: None if it is not to be logged; else how
        many failures before it were held back (to say so in its line)."""
        if now_ms - self._window_start_ms >= LOG_WINDOW_MS:
            self._window_start_ms = now_ms
            self._logged = 0
        if self._logged >= LOG_BURST:
            self._held += 1
            return None
        self._logged += 1
        held, self._held = self._held, 0
        return held
