"""Decoding acquired bytes: images with pillow, video with PyAV (frames sampled at a rate).

Both refuse what they cannot read with invalid_media (an unsupported or corrupt format) and what
decodes past the pixel budget with media_budget_exceeded.
"""

from __future__ import annotations

import io
import logging

from ninfer_core.engine.api import EngineError
from ninfer_core.media.sources import invalid_media

log = logging.getLogger("ninfer.media")

MAX_DECODED_PIXELS = 8192 * 8192  # one image or frame; past it pillow's bomb check would fire anyway


def _budget(what: str, pixels: int, limit: int, param: str | None) -> EngineError:
    return EngineError(400, "media_budget_exceeded",
                       f"{what} decodes to {pixels} pixels, above the budget of {limit}.", param=param)


def decode_image(data: bytes, mime: str | None, param: str | None):
    """An RGB PIL image from encoded bytes."""
    from PIL import Image, UnidentifiedImageError

    if mime and not mime.lower().startswith("image/") and mime.lower() not in ("application/octet-stream",):
        raise invalid_media(f"An image part holds {mime!r} content; send an image (PNG, JPEG, WebP, GIF, ...).", param)
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > MAX_DECODED_PIXELS:
                raise _budget("The image", w * h, MAX_DECODED_PIXELS, param)
            img.load()
            rgb = img.convert("RGB")
    except EngineError:
        raise
    except UnidentifiedImageError:
        raise invalid_media("The image data is not in a supported image format.", param) from None
    except Image.DecompressionBombError:
        raise _budget("The image", 0, MAX_DECODED_PIXELS, param) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise invalid_media(f"The image data could not be decoded ({type(e).__name__}).", param) from None
    if rgb.width < 1 or rgb.height < 1:
        raise invalid_media("The image has no pixels.", param)
    return rgb


def decode_video(data: bytes, mime: str | None, param: str | None, fps: float, max_frames: int):
    """(RGB PIL frames, their times in seconds), sampled at `fps` (at most `max_frames`, at least 2)."""
    try:
        import av
    except ImportError:  # pragma: no cover - av is a core dependency
        raise invalid_media("Video input needs PyAV (pip install av), which this server lacks.", param) from None
    if mime and not (mime.lower().startswith("video/") or mime.lower() in ("application/octet-stream",
                                                                           "image/gif")):
        raise invalid_media(f"A video part holds {mime!r} content; send a video (MP4, WebM, ...).", param)
    frames, times = [], []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise invalid_media("The video data has no video stream.", param)
            stream = container.streams.video[0]
            base = stream.time_base
            decoded = []
            for frame in container.decode(stream):
                t = float(frame.pts * base) if frame.pts is not None and base is not None else len(decoded) / 24.0
                if frame.width * frame.height > MAX_DECODED_PIXELS:
                    raise _budget("A video frame", frame.width * frame.height, MAX_DECODED_PIXELS, param)
                decoded.append((t, frame))
                if len(decoded) > 100_000:
                    raise _budget("The video", len(decoded), 100_000, param)
            if not decoded:
                raise invalid_media("The video data holds no frames.", param)
            t0 = decoded[0][0]
            duration = decoded[-1][0] - t0
            want = max(2, min(max_frames, int(duration * fps) + 1))
            want -= want % 2  # whole temporal patches
            step = len(decoded) / want
            for i in range(want):
                t, frame = decoded[min(len(decoded) - 1, int(i * step))]
                frames.append(frame.to_image().convert("RGB"))
                times.append(t - t0)
    except EngineError:
        raise
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise invalid_media(f"The video data could not be decoded ({type(e).__name__}).", param) from None
    return frames, times
