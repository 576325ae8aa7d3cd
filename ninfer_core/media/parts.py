"""Media content parts of each protocol -> MediaRef (field checks in the protocol's own terms).

Chat Completions: {"type": "image_url", "image_url": {"url", "detail"} | "url"} and the
{"type": "video_url", "video_url": {"url"} | "url"} extension; Responses: {"type": "input_image",
"image_url": "url", "detail"} and {"type": "input_video", "video_url": ...}; Anthropic image
blocks {"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}.
A part becomes {"type": "image"|"video", "media": MediaRef} in the normalized message content.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.media.api import DETAILS, IMAGE, VIDEO, MediaRef
from ninfer_core.media.prompt import MEDIA_KEY

ANTHROPIC_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _bad(code: str, message: str, param: str) -> EngineError:
    return EngineError(400, code, message, param=param)


def detail_of(value: Any, param: str, lenient: bool) -> str:
    """auto | low | high; anything else is image_detail_not_supported (auto with --lenient-image-detail)."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value in DETAILS:
        return value
    if lenient:
        return "auto"
    raise _bad("image_detail_not_supported", f"image detail {value!r} is not supported: use auto, low or high.",
               param)


def media_part(kind: str, ref: MediaRef) -> dict:
    return {"type": kind, MEDIA_KEY: ref}


def openai_part(part: dict, param: str, lenient: bool) -> dict:
    """A Chat Completions or Responses media part -> a normalized media part."""
    kind = part.get("type")
    is_video = kind in ("video_url", "input_video", "video")
    field = "video_url" if is_video else "image_url"
    value = part.get(field)
    detail = part.get("detail")
    url_param = f"{param}.{field}"
    if isinstance(value, dict):
        url = value.get("url")
        url_param = f"{param}.{field}.url"
        if "detail" in value:
            detail = value.get("detail")
            detail_param = f"{param}.{field}.detail"
        else:
            detail_param = f"{param}.detail"
    else:
        url = value
        detail_param = f"{param}.detail"
    if url is None:
        if part.get("file_id") is not None:
            raise _bad("content_type_not_supported", "image file_id references are not supported: send the image "
                       "as a URL or data URI.", f"{param}.file_id")
        raise _bad("missing_required_parameter", f"a {kind} part needs its '{field}'.", url_param)
    if not isinstance(url, str):
        raise _bad("invalid_type", f"'{field}' must be a URL string.", url_param)
    ref = MediaRef(VIDEO if is_video else IMAGE, url,
                   "auto" if is_video else detail_of(detail, detail_param, lenient), url_param)
    return media_part(ref.kind, ref)


def anthropic_image(block: dict, param: str) -> dict:
    """An Anthropic image block -> a normalized media part (base64 or url sources)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad("invalid_request_error", "an image block needs a 'source' object.", f"{param}.source")
    kind = source.get("type")
    if kind == "base64":
        mime, data = source.get("media_type"), source.get("data")
        if not isinstance(mime, str) or mime not in ANTHROPIC_IMAGE_TYPES:
            raise _bad("invalid_media", f"image media_type must be one of {', '.join(ANTHROPIC_IMAGE_TYPES)}, got "
                       f"{mime!r}.", f"{param}.source.media_type")
        if not isinstance(data, str) or not data:
            raise _bad("invalid_media", "a base64 image source needs its 'data'.", f"{param}.source.data")
        ref = MediaRef(IMAGE, f"data:{mime};base64,{data}", "auto", f"{param}.source.data")
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _bad("invalid_media", "a url image source needs its 'url'.", f"{param}.source.url")
        ref = MediaRef(IMAGE, url, "auto", f"{param}.source.url")
    elif kind == "file":
        raise _bad("content_type_not_supported", "image file sources (the Files API) are not supported: send "
                   "base64 data or a URL.", f"{param}.source.type")
    else:
        raise _bad("invalid_media", f"unknown image source type {kind!r}: use base64 or url.", f"{param}.source.type")
    return media_part(IMAGE, ref)
