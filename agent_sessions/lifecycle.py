"""Managing conversations rather than running them (docs/lifecycle.md): the argument checks, the
metadata's stored form and the cursor format of list, inspect, label, delete and prune, once, so every
store refuses the same input the same way.

``updated`` is when the session's row was last written (a save, the lease's take, renewal or release, a
journal write, a metadata change); a leased run's steps append without touching it, so during a run it
lags by at most a third of ``lease_ttl``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta

from .errors import ArgumentError
from .validate import encodable
from .values import Scalar, SessionInfo, SessionPage

MAX_METADATA_KEYS = 32
MAX_METADATA_BYTES = 4096
"""The whole object, as compact JSON: metadata labels a conversation; it is not a second transcript."""
MAX_VALUE_BYTES = 255
"""One value's JSON form: it is indexed (the ``where`` filter), and index keys are bounded."""
MAX_PAGE = 1000
_LAST_SECOND = 253402300799
"""9999-12-31T23:59:59Z: a cursor's time beyond it (or NaN, or before 1970) was never a store's ``updated``."""
_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


# -- the checks every LifecycleStore makes ------------------------------------------------------------------


def metadata_key(key: object, where: str = "metadata") -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ArgumentError(f"{where} key {key!r} must be a str of 1 to 64 characters from A-Z a-z 0-9 _ . : -")
    return key


def metadata_value(key: str, value: object, where: str = "metadata") -> str:
    """The value's JSON form (what stores index and compare), after checking it is a bounded scalar."""
    if not isinstance(value, (str, int, float, bool)):
        raise ArgumentError(f"{where}[{key!r}] must be a str, int, float or bool (a JSON scalar), got "
                            f"{type(value).__name__}")
    if isinstance(value, int) and value.bit_length() > 4 * MAX_VALUE_BYTES:  # more digits than the bytes allowed
        raise ArgumentError(f"{where}[{key!r}] is an int of {value.bit_length()} bits; values are indexed as JSON "
                            f"and may be at most {MAX_VALUE_BYTES} bytes")  # json.dumps would raise ValueError
    if isinstance(value, float) and not math.isfinite(value):
        raise ArgumentError(f"{where}[{key!r}] must be finite, got {value!r}")
    if isinstance(value, str) and not encodable(value):
        raise ArgumentError(f"{where}[{key!r}] contains NUL or a lone surrogate")
    text = json.dumps(value)
    if len(text) > MAX_VALUE_BYTES:
        raise ArgumentError(f"{where}[{key!r}] is {len(text)} bytes as JSON; values are indexed and may be at most "
                            f"{MAX_VALUE_BYTES} bytes")
    return text


def merge_metadata(stored: Mapping[str, Scalar], changes: object) -> dict[str, Scalar]:
    """``stored`` with ``changes`` merged in (``None`` removes a key), checked: the store writes this."""
    if not isinstance(changes, Mapping):
        raise ArgumentError(f"set_metadata(changes) must be a mapping, got {type(changes).__name__}")
    merged = dict(stored)
    for key, value in changes.items():
        metadata_key(key, "set_metadata")
        if value is None:
            merged.pop(key, None)
        else:
            metadata_value(key, value, "set_metadata")
            merged[key] = value
    if len(merged) > MAX_METADATA_KEYS:
        raise ArgumentError(f"set_metadata: the merged metadata has {len(merged)} keys; at most "
                            f"{MAX_METADATA_KEYS} are allowed")
    size = len(encode_metadata(merged))
    if size > MAX_METADATA_BYTES:
        raise ArgumentError(f"set_metadata: the merged metadata is {size:,} bytes as JSON; at most "
                            f"{MAX_METADATA_BYTES:,} are allowed")
    return merged


def encode_metadata(metadata: Mapping[str, Scalar]) -> str:
    return json.dumps(metadata, separators=(",", ":"), sort_keys=True)


def decode_metadata(text: str | None) -> dict[str, Scalar]:
    if not text:
        return {}
    value = json.loads(text)
    assert isinstance(value, dict)
    return value


def check_listing(prefix: object, where: object, limit: object, after: object) -> dict[str, str]:
    """Check ``list_sessions``' arguments; return ``where`` as {key: the value's JSON form}."""
    if not isinstance(prefix, str) or not encodable(prefix):
        raise ArgumentError(f"list_sessions(prefix=) must be a str without NUL, got {prefix!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ArgumentError(f"list_sessions(limit=) must be an int from 1 to {MAX_PAGE}, got {limit!r}")
    if after is not None:
        decode_cursor(after)
    if where is None:
        return {}
    if not isinstance(where, Mapping):
        raise ArgumentError(f"list_sessions(where=) must be a mapping of metadata keys to values, got {where!r}")
    return {metadata_key(k, "where"): metadata_value(k, v, "where") for k, v in where.items()}


def check_stranded(prefix: object, where: object, limit: object, after: object, grace: object) -> float:
    """Check ``list_sessions(stranded=True)``'s arguments; return ``grace`` as seconds."""
    check_listing("", None, limit, after)
    if prefix != "" or where:
        raise ArgumentError("list_sessions(stranded=True) lists by open_since alone: leave prefix and where out")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < math.inf:
        raise ArgumentError(f"list_sessions(grace=) must be seconds (a finite number >= 0), got {grace!r}")
    return float(grace)


def encode_cursor(updated: float, session: str) -> str:
    """A page's ``next``: where the page ended (its last session's ``updated`` and id). Opaque to users."""
    raw = json.dumps([updated, session], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: object) -> tuple[float, str]:
    if isinstance(cursor, str):
        try:
            data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        except (ValueError, binascii.Error):
            data = None
        if (isinstance(data, list) and len(data) == 2 and isinstance(data[0], (int, float))
                and not isinstance(data[0], bool) and 0 <= data[0] <= _LAST_SECOND and isinstance(data[1], str)
                and data[1] and encodable(data[1])):
            return float(data[0]), data[1]
    raise ArgumentError(f"list_sessions(after=) must be a page's next cursor, got {cursor!r}")


def page(rows: Sequence[tuple[float, SessionInfo]], limit: int) -> SessionPage:
    """The page of ``rows`` (a store's query for ``limit + 1`` rows, each with its ``updated`` as stored):
    the extra row, if any, says there is a next page."""
    shown = rows[:limit]
    more = len(rows) > limit
    return SessionPage([info for _, info in shown],
                       encode_cursor(shown[-1][0], shown[-1][1].id) if more and shown else None)


def idle_seconds(idle_for: object) -> float:
    if isinstance(idle_for, timedelta):
        idle_for = idle_for.total_seconds()
    if isinstance(idle_for, bool) or not isinstance(idle_for, (int, float)) or not 0 <= idle_for < math.inf:
        raise ArgumentError(f"prune(idle_for=) must be seconds (a finite number >= 0) or a timedelta, got {idle_for!r}")
    return float(idle_for)


def prune_limit(limit: object) -> int | None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ArgumentError(f"prune(limit=) must be None or an int >= 1, got {limit!r}")
    return limit


def last_count(last: object) -> int:
    if isinstance(last, bool) or not isinstance(last, int) or last < 0:
        raise ArgumentError(f"messages(last=) must be an int >= 0, got {last!r}")
    return last
