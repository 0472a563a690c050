"""HTTP for the endpoints: a ``requests.Session`` per thread, urllib3's ``Retry`` for statuses and broken
connections, a deadline on the whole response, and provider errors turned into EndpointError."""

from __future__ import annotations

import email.utils
import json
import logging
import math
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connectionpool import ConnectionPool
from urllib3.exceptions import ReadTimeoutError
from urllib3.response import BaseHTTPResponse
from urllib3.util.retry import Retry

from ..errors import ArgumentError, ContextOverflow, EndpointError
from ..messages import Content, Message, Role

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


class HTTPClient:
    """POSTs JSON and returns the decoded object. Each thread gets its own ``requests.Session``, since
    requests does not promise that one is safe to share and an endpoint often is shared; a caller's
    ``session`` is used by every thread instead, with the retrying adapter mounted for ``base_url`` only.
    ``timeout`` bounds the whole response (a body trickled a byte at a time is cut off) from the start of
    the attempt that answered; ``_Retry`` says what is retried."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        *,
        timeout: float,
        max_retries: int,
        backoff: float,
        max_backoff: float,
        session: requests.Session | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ArgumentError(f"endpoint base_url must be an http(s) URL, got {base_url!r}")
        if max_retries < 0:
            raise ArgumentError(f"endpoint max_retries must be >= 0, got {max_retries}")
        if timeout <= 0:
            raise ArgumentError(f"endpoint timeout must be > 0 seconds, got {timeout}")
        if session is not None and not isinstance(session, requests.Session):
            raise ArgumentError(f"endpoint session must be a requests.Session, got {type(session).__name__}")
        for name, value in headers.items():  # the values are not quoted back: one may be a key
            if not isinstance(name, str) or not isinstance(value, str):
                raise ArgumentError(f"endpoint headers must map str to str; {name!r} is a {type(value).__name__}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = {"content-type": "application/json", **headers}
        self.retry = _Retry(
            total=max_retries,
            other=0,  # a TLS error: a bad certificate does not heal
            status_forcelist=RETRY_STATUSES,
            allowed_methods=frozenset({"POST"}),
            backoff_factor=backoff,
            backoff_max=max_backoff,
            respect_retry_after_header=True,
            raise_on_status=False,  # the last answer is decoded into an EndpointError with the provider's text
        )
        self._callers = session
        if session is not None:
            session.mount(self.base_url + "/", HTTPAdapter(max_retries=self.retry))
        self._local = threading.local()
        self._made: weakref.WeakSet[requests.Session] = weakref.WeakSet()  # a dead thread's goes with it
        self._lock = threading.Lock()

    def post(self, path: str, body: str) -> dict[str, Any]:
        url, response, deadline = self._send(path, body, self.headers)
        return _decode(url, response, _read(url, response, deadline, self.timeout))

    def stream(self, path: str, body: str, handle: Callable[[str, str], bool]) -> dict[str, Any] | None:
        """POSTs JSON that asks for server-sent events and hands each to ``handle(event, data)`` as it
        arrives; ``handle`` returns True for the one that ends the stream. Returns None once it has ended,
        or the decoded object of a server that answered with plain JSON instead. Nothing is retried once
        the body has begun: the deltas handed on cannot be taken back."""
        url, response, deadline = self._send(path, body, {**self.headers, "accept": "text/event-stream"})
        kind = response.headers.get("content-type", "")
        if response.status_code >= 400 or not kind.lower().startswith("text/event-stream"):
            return _decode(url, response, _read(url, response, deadline, self.timeout))
        _read_events(url, response, deadline, self.timeout, handle)
        return None

    def _send(self, path: str, body: str, headers: Mapping[str, str]) -> tuple[str, requests.Response, float]:
        """The response, its headers read and its body not, and the deadline for the whole of it."""
        url = self.base_url + path
        started = time.monotonic()
        try:
            response = self._session().post(
                url, data=body.encode("utf-8"), headers=headers, timeout=self.timeout, stream=True
            )
        except requests.ConnectionError as exc:
            raise EndpointError(f"cannot reach {url}: {exc}") from exc
        except requests.RequestException as exc:
            raise EndpointError(f"request to {url} failed: {exc}") from exc
        # After retries, the deadline counts from the attempt that answered: _Retry.sleep noted its start.
        retried = getattr(getattr(response.raw, "retries", None), "attempt_started", None)
        return url, response, (retried or started) + self.timeout

    def _session(self) -> requests.Session:
        if self._callers is not None:
            return self._callers
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            adapter = HTTPAdapter(max_retries=self.retry)
            session.mount("https://", adapter)
            session.mount("http://", adapter)
            self._local.session = session
            with self._lock:
                self._made.add(session)
        return session

    def close(self) -> None:
        """Closes the sessions this client made, every thread's (not a caller's own)."""
        with self._lock:
            made = list(self._made)
        for session in made:
            session.close()


class _Retry(Retry):
    """urllib3's Retry, but: a read timeout is not retried (the server may still be working on the request,
    and a hung one should fail within the timeout); a response about to be retried is closed, not drained
    (urllib3 would read a trickling body to its end); the first retry waits too, with jitter, so that clients
    an overloaded provider turned away do not all come back in step; a ``Retry-After`` that cannot be read
    means the usual backoff (urllib3 would raise InvalidHeader from inside requests)."""

    RETRY_AFTER_STATUS_CODES = RETRY_STATUSES  # urllib3 would also retry a 413 that sends Retry-After
    wait = 0.0
    attempt_started: float | None = None

    def increment(
        self,
        method: str | None = None,
        url: str | None = None,
        response: BaseHTTPResponse | None = None,
        error: Exception | None = None,
        _pool: ConnectionPool | None = None,
        _stacktrace: TracebackType | None = None,
    ) -> Self:
        if isinstance(error, ReadTimeoutError):
            raise error.with_traceback(_stacktrace)
        retry = super().increment(method, url, response, error, _pool, _stacktrace)  # MaxRetryError when spent
        asked = response.headers.get("retry-after") if response is not None else None
        seconds = _retry_after_seconds(asked) if self.respect_retry_after_header else None
        retry.wait = min(max(retry.get_backoff_time() if seconds is None else seconds, 0.0), self.backoff_max)
        if response is not None:
            response.close()
        failed = len(retry.history)
        log.warning(
            "%s %s%s, attempt %d of %d: %s; retrying in %.2f s%s",
            method, url, f" at {_pool.host}:{_pool.port}" if _pool is not None else "",
            failed, failed + 1 + int(retry.total or 0),  # total: the retries still allowed
            f"status {response.status}" if response is not None else f"{type(error).__name__}: {error}",
            retry.wait, f" (Retry-After: {asked})" if asked else "",
        )
        return retry

    def get_backoff_time(self) -> float:
        return float(self.backoff_factor * 2 ** max(len(self.history) - 1, 0) * (0.5 + random.random()))

    def sleep(self, response: BaseHTTPResponse | None = None) -> None:
        time.sleep(self.wait)
        self.attempt_started = time.monotonic()


def _retry_after_seconds(value: str | None) -> float | None:
    """Seconds (fractions accepted, though the RFC says an integer) or an HTTP date; None for anything
    else, NaN included, which would make time.sleep raise."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


def _read(url: str, response: requests.Response, deadline: float, timeout: float) -> str:
    chunks: list[bytes] = []
    try:
        for chunk in _chunks(url, response, "response"):
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise EndpointError(f"{url} did not finish its response within the timeout of {timeout} s",
                                    status=response.status_code)
    finally:
        response.close()
    return b"".join(chunks).decode("utf-8", errors="replace")


def _chunks(url: str, response: requests.Response, what: str = "stream") -> Iterator[bytes]:
    """The body as it arrives: ``read1`` gives whatever one socket read has, so that a caller checks its
    deadline between reads even when a server sends a byte at a time (urllib3 1.x: whole chunks)."""
    raw: Any = response.raw
    pieces: Iterator[bytes] = (
        iter(lambda: raw.read1(65536, decode_content=True), b"") if hasattr(raw, "read1")
        else response.iter_content(chunk_size=65536)
    )
    received = 0
    while True:
        try:
            chunk = next(pieces, b"")
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise EndpointError(
                f"the {what} from {url} broke off after {received} bytes: {exc}", status=response.status_code
            ) from exc
        if not chunk:
            return
        received += len(chunk)
        yield chunk


def _read_events(
    url: str, response: requests.Response, deadline: float, timeout: float, handle: Callable[[str, str], bool]
) -> None:
    """Server-sent events (the WHATWG format), handed to ``handle`` as each one completes. Lines are split
    here, on bytes, not by requests' ``iter_lines``, which reads a CRLF split between two reads as a blank
    line: an event dispatched too early."""
    events = _Events(handle)
    received = 0
    chunks = _chunks(url, response)
    try:
        for chunk in chunks:
            received += len(chunk)
            if events.feed(chunk):
                break
            if time.monotonic() > deadline:
                raise EndpointError(
                    f"{url} did not finish its stream within the timeout of {timeout} s",
                    status=response.status_code,
                )
        else:
            if not events.feed(b"", end=True):
                raise EndpointError(
                    f"the stream from {url} ended after {received} bytes, before its end",
                    status=response.status_code,
                )
        if events.done:
            _rest_of_body(chunks, response)
    except EndpointError:
        if not events.done:
            raise
        log.debug("after the end of the stream from %s", url, exc_info=True)
    finally:
        response.close()


END_READ = 0.05


def _rest_of_body(chunks: Iterator[bytes], response: requests.Response) -> None:
    """What follows the end event (normally the chunked encoding's last chunk), read for ``END_READ``
    seconds at most, so that the connection goes back to the pool: a server that holds the body open then
    costs its connection, not the caller's time."""
    connection = getattr(response.raw, "connection", None)  # urllib3 2; 1.x: no wait, the connection dropped
    sock = getattr(connection, "sock", None)
    if sock is None:
        return
    until = time.monotonic() + END_READ
    previous = sock.gettimeout()
    sock.settimeout(END_READ)
    try:
        for _ in chunks:
            if time.monotonic() > until:
                break
    finally:
        if sock.fileno() != -1:  # urllib3 closed it if a read timed out
            sock.settimeout(previous)  # urllib3 sets its own for the connection's next request, but be sure


class _Events:
    __slots__ = ("data", "done", "event", "handle", "pending")

    def __init__(self, handle: Callable[[str, str], bool]) -> None:
        self.handle = handle
        self.pending = b""
        self.event = ""
        self.data: list[str] = []
        self.done = False

    def feed(self, chunk: bytes, *, end: bool = False) -> bool:
        """True once the end event has been handled (the SSE line and event state are kept between reads)."""
        lines = (self.pending + chunk).splitlines(keepends=True)
        # The last line is incomplete without its end, and one ending in CR may be half of a CRLF.
        self.pending = lines.pop() if lines and not end and not lines[-1].endswith(b"\n") else b""
        for raw in lines:
            if not raw.endswith((b"\n", b"\r")):
                break  # the body's last bytes, unended: an incomplete line, which SSE discards
            line = raw.rstrip(b"\r\n").decode("utf-8", errors="replace")
            if not line:
                if self.data and self.handle(self.event, "\n".join(self.data)):
                    self.done = True
                    return True
                self.event, self.data = "", []
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                self.data.append(value)
            elif name == "event":
                self.event = value
        return False


def _decode(url: str, response: requests.Response, text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if response.status_code >= 400:
        message = _provider_message(data) or text[:2000]
        raise overflow(data, message, status=response.status_code, body=text) or EndpointError(
            message, status=response.status_code, body=text
        )
    if not isinstance(data, dict):
        raise EndpointError(
            f"{url} answered {response.status_code} with a body that is not a JSON object: {text[:200]!r}",
            status=response.status_code,
            body=text,
        )
    return data


def _provider_message(data: object) -> str | None:
    """OpenAI and Anthropic both say ``{"error": {"message": ...}}``; some servers give a bare string."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    if isinstance(data.get("message"), str):
        return str(data["message"])
    return None


_OPENAI_LIMIT = re.compile(r"maximum context length is (\d+) tokens")
_OPENAI_TOKENS = re.compile(r"(?:resulted in|requested) (\d+) tokens")
_ANTHROPIC = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")


def overflow(data: object, message: str, *, status: int | None, body: str) -> ContextOverflow | None:
    """The provider's context-length error as a ContextOverflow with its counts (None where its text gives
    none), or None for any other error: OpenAI's (and vLLM's, llama.cpp's) ``context_length_exceeded`` or
    "maximum context length is M tokens", Anthropic's "prompt is too long: N tokens > M maximum"."""
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if found := _ANTHROPIC.search(message):
        return ContextOverflow(message, status=status, body=body, tokens=int(found[1]), limit=int(found[2]))
    limit = _OPENAI_LIMIT.search(message)
    if code != "context_length_exceeded" and limit is None:
        return None
    tokens = _OPENAI_TOKENS.search(message)
    return ContextOverflow(message, status=status, body=body, tokens=int(tokens[1]) if tokens else None,
                           limit=int(limit[1]) if limit else None)


def unstreamed(message: Message, on_text: Callable[[str], None] | None) -> Message:
    """The reply of a server that answered a stream request with plain JSON: its text goes to ``on_text``
    in one piece."""
    if on_text is not None and message.text:
        on_text(message.text)
    return message


def reply(content: list[Content], usage: dict[str, int] | None) -> Message:
    """The assistant's reply; an empty text when the model said nothing."""
    return Message(Role.ASSISTANT, content or [Content.from_text("")], usage=usage)


def malformed(what: str, body: object) -> EndpointError:
    return EndpointError(f"malformed response: {what}; got {json.dumps(body)[:300]}", status=200)


def usage_of(data: dict[str, Any]) -> dict[str, int] | None:
    """The provider's token counts: the whole-number fields of its ``usage`` object, as named there."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None
    counts = {k: v for k, v in usage.items() if isinstance(k, str) and type(v) is int}
    return counts or None


def stream_json(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise EndpointError(f"malformed stream: an event's data is not a JSON object: {data[:300]!r}",
                            status=200, body=data)
    return value


def stream_error(data: dict[str, Any], text: str) -> EndpointError:
    """The error a provider reported in the middle of a stream (its status was 200 when it began)."""
    error = data.get("error")
    kind = error.get("type") if isinstance(error, dict) else None
    what = _provider_message(data) or text[:300]
    return overflow(data, what, status=200, body=text) or EndpointError(
        f"the stream reported an error: {what}" + (f" ({kind})" if isinstance(kind, str) else ""),
        status=200, body=text)
