"""Media acquisition: the bytes behind a data URI or an http(s) URL, under size and time limits.

Failures are EngineErrors in the spec's codes: invalid_media (400) for a malformed source or
bytes, media_budget_exceeded (400) for a source over the byte budget, media_fetch_failed (502)
when a remote fetch fails and media_fetch_timeout (504) when it runs out of time. The protocol's
error mapper shapes them (Anthropic maps the timeout to its timeout_error).
"""

from __future__ import annotations

import base64
import binascii
import re
import time
import urllib.parse

from ninfer_core.engine.api import EngineError

_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)
_B64_JUNK = re.compile(r"\s+")


def invalid_media(message: str, param: str | None) -> EngineError:
    return EngineError(400, "invalid_media", message, param=param)


def too_large(what: str, size: int, limit: int, param: str | None) -> EngineError:
    return EngineError(400, "media_budget_exceeded",
                       f"{what} is {size} bytes, above the media source budget of {limit} bytes.", param=param)


def decode_data_uri(url: str, limit: int, param: str | None) -> tuple[bytes, str | None]:
    """(bytes, declared MIME type) of a data URI; base64 or percent-encoded payloads."""
    m = _DATA_URI.match(url)
    if m is None:
        raise invalid_media("The media data URI is malformed: expected data:<type>;base64,<data>.", param)
    payload = url[m.end():]
    if m.group("b64"):
        # the base64 text bounds the decoded size: refuse before decoding what cannot fit
        if len(payload) * 3 // 4 > limit + 3:
            raise too_large("The media data", len(payload) * 3 // 4, limit, param)
        try:
            data = base64.b64decode(_B64_JUNK.sub("", payload), validate=True)
        except (binascii.Error, ValueError):
            raise invalid_media("The media data URI does not hold valid base64.", param) from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > limit:
        raise too_large("The media data", len(data), limit, param)
    if not data:
        raise invalid_media("The media data URI is empty.", param)
    return data, (m.group("mime") or None)


def fetch_url(url: str, limit: int, timeout_s: float, param: str | None) -> tuple[bytes, str | None]:
    """(bytes, Content-Type) of an http(s) URL, streamed so a large body stops at the limit."""
    import httpx

    deadline = time.monotonic() + timeout_s
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=True, max_redirects=5) as client, \
                client.stream("GET", url, headers={"Accept": "image/*, video/*"}) as resp:
            if resp.status_code >= 400:
                raise EngineError(502, "media_fetch_failed",
                                  f"Fetching the media URL failed: the server answered HTTP {resp.status_code}.",
                                  param=param, type_="server_error")
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > limit:
                raise too_large("The media at the URL", int(declared), limit, param)
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                if time.monotonic() > deadline:  # httpx bounds each read; this bounds the whole fetch
                    raise httpx.ReadTimeout("the whole fetch took too long")
                size += len(chunk)
                if size > limit:
                    raise too_large("The media at the URL", size, limit, param)
                chunks.append(chunk)
            mime = (resp.headers.get("content-type") or "").split(";")[0].strip() or None
            return b"".join(chunks), mime
    except httpx.TimeoutException:
        raise EngineError(504, "media_fetch_timeout", f"Fetching the media URL took longer than {timeout_s:g} s.",
                          param=param, type_="server_error") from None
    except httpx.HTTPError as e:
        raise EngineError(502, "media_fetch_failed", f"Fetching the media URL failed: {type(e).__name__}.",
                          param=param, type_="server_error") from None


def acquire(url: str, limit: int, timeout_s: float, param: str | None) -> tuple[bytes, str | None]:
    """The bytes of a media source: a data URI or an http(s) URL (other schemes are refused)."""
    if not isinstance(url, str) or not url:
        raise invalid_media("A media part needs a non-empty URL.", param)
    head = url[:8].lower()
    if head.startswith("data:"):
        return decode_data_uri(url, limit, param)
    if head.startswith(("http://", "https://")):
        return fetch_url(url, limit, timeout_s, param)
    scheme = url.split(":", 1)[0] if ":" in url else ""
    raise invalid_media(f"Media sources must be http(s) URLs or base64 data URIs, not {scheme or 'a bare path'!r}.",
                        param)
