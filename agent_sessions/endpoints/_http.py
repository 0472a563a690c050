"""One ``requests.Session`` per endpoint, bounded retries, and provider errors turned into EndpointError."""

from __future__ import annotations

import email.utils
import json
import random
import time
from collections.abc import Mapping
from typing import Any

import requests
import urllib3

from ..errors import ArgumentError, EndpointError

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


class HTTPClient:
    """POSTs JSON and returns the decoded object.

    Retries connection failures and 408/409/429/5xx/529 up to ``max_retries`` times with exponential
    backoff and jitter, waiting what ``Retry-After`` asks where it is given (capped at ``max_backoff``).
    A read timeout is not retried: a hung endpoint fails within ``timeout`` rather than a multiple of it.
    ``timeout`` also bounds the whole response: a server that trickles its body a byte at a time (each
    read arriving before the socket timeout) is cut off once ``timeout`` has passed since the request.
    """

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        *,
        timeout: float,
        max_retries: int,
        backoff: float,
        max_backoff: float,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ArgumentError(f"endpoint base_url must be an http(s) URL, got {base_url!r}")
        if max_retries < 0:
            raise ArgumentError(f"endpoint max_retries must be >= 0, got {max_retries}")
        if timeout <= 0:
            raise ArgumentError(f"endpoint timeout must be > 0 seconds, got {timeout}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.http = requests.Session()
        self.http.headers.update({"content-type": "application/json", **headers})

    def post(self, path: str, body: str) -> dict[str, Any]:
        url = self.base_url + path
        data = body.encode("utf-8")
        attempt = 0
        while True:
            deadline = time.monotonic() + self.timeout
            try:
                response = self.http.post(url, data=data, timeout=self.timeout, stream=True)
            except requests.ConnectionError as exc:
                if attempt >= self.max_retries:
                    raise EndpointError(f"cannot reach {url}: {exc}") from exc
                self._sleep(attempt, None)
                attempt += 1
                continue
            except requests.RequestException as exc:
                raise EndpointError(f"request to {url} failed: {exc}") from exc
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                response.close()
                self._sleep(attempt, response.headers.get("retry-after"))
                attempt += 1
                continue
            return _decode(url, response, _read(url, response, deadline, self.timeout))

    def _sleep(self, attempt: int, retry_after: str | None) -> None:
        delay = _retry_after_seconds(retry_after)
        if delay is None:
            delay = self.backoff * (2**attempt) * (0.5 + random.random())
        time.sleep(min(max(delay, 0.0), self.max_backoff))

    def close(self) -> None:
        self.http.close()


def _retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


def _read(url: str, response: requests.Response, deadline: float, timeout: float) -> str:
    """The body, read as it arrives (``read1``: whatever one socket read gives), so that the deadline is
    checked between reads even when a server sends a byte at a time."""
    raw: Any = response.raw
    read = (lambda: raw.read1(65536, decode_content=True)) if hasattr(raw, "read1") else None
    chunks: list[bytes] = []
    try:
        if read is None:  # urllib3 1.x: whole chunks only
            chunks.extend(response.iter_content(chunk_size=65536))
        else:
            while chunk := read():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise EndpointError(
                        f"{url} did not finish its response within the timeout of {timeout} s",
                        status=response.status_code,
                    )
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise EndpointError(
            f"the response from {url} broke off after {sum(map(len, chunks))} bytes: {exc}",
            status=response.status_code,
        ) from exc
    finally:
        response.close()
    return b"".join(chunks).decode("utf-8", errors="replace")


def _decode(url: str, response: requests.Response, text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if response.status_code >= 400:
        raise EndpointError(_provider_message(data) or text[:2000], status=response.status_code, body=text)
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


def malformed(what: str, body: object) -> EndpointError:
    return EndpointError(f"malformed response: {what}; got {json.dumps(body)[:300]}", status=200)
