"""The media serve options (spec "Server options": --vision and the media caches)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ninfer_core.cli_support import integer, number

CPU_DEFAULT_MAX_MERGED = 256  # spec: the cpu residency caps --vision-max-merged at 256 unless given
DEFAULT_MAX_MERGED = 16384
LOW_DETAIL_MERGED = 256  # spec "Image detail": low is the area of a 512 x 512 picture


@dataclass
class MediaOptions:
    vision: bool = False
    residency: str = "resident"
    max_merged: int | None = None  # None: the residency's default
    cache_mib: int = 1024
    live_mib: int = 2048
    preprocess_threads: int = 0
    lenient_image_detail: bool = False
    fetch_timeout_s: float = 30.0

    def merged_bound(self) -> int:
        if self.max_merged is not None:
            return self.max_merged
        return CPU_DEFAULT_MAX_MERGED if self.residency == "cpu" else DEFAULT_MAX_MERGED


def add_media_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vision and media")
    g.add_argument("--vision", action="store_true",
                   help="enable image and video input and load the artifact's vision tower (default off: media "
                        "requests fail with vision_disabled)")
    g.add_argument("--vision-residency", default=None, metavar="NAME",
                   help="where the vision tower lives: resident (on the device), cpu (FP32 on host threads), or "
                        "another registered residency; requires --vision (default resident)")
    g.add_argument("--vision-offload", choices=("on", "off"), default=None,
                   help="alias of --vision-residency overlay (on) or resident (off) (default: unset)")
    g.add_argument("--vision-cpu", action="store_true", help="--vision with --vision-residency cpu (default off)")
    g.add_argument("--vision-max-merged", type=integer(64, 16384), default=None, metavar="N",
                   help="merged-token budget of one media item, 64..16384; larger media is downscaled "
                        "(default 16384; 256 with --vision-residency cpu)")
    g.add_argument("--media-cache-mib", type=integer(0), default=1024, metavar="N",
                   help="LRU-retained prepared media payloads in MiB; 0 disables retention (default 1024)")
    g.add_argument("--media-live-mib", type=integer(1), default=2048, metavar="N",
                   help="all live prepared media payloads in MiB (default 2048)")
    g.add_argument("--media-preprocess-threads", type=integer(0, 256), default=0, metavar="N",
                   help="media preprocessing workers; 0 picks at most 16 from the host's cores (default 0)")
    g.add_argument("--media-fetch-timeout-s", type=number(0, 3600, lo_open=True), default=30.0, metavar="S",
                   help="time limit of one media URL fetch in seconds (default 30.0)")
    g.add_argument("--lenient-image-detail", action="store_true",
                   help="read an unknown OpenAI image detail as auto instead of failing with "
                        "image_detail_not_supported (default off)")


def media_options_from_args(a: argparse.Namespace) -> MediaOptions:
    vision = bool(getattr(a, "vision", False) or getattr(a, "vision_cpu", False))
    residency = getattr(a, "vision_residency", None)
    offload = getattr(a, "vision_offload", None)
    if getattr(a, "vision_cpu", False):
        if residency not in (None, "cpu"):
            raise ValueError(f"--vision-cpu conflicts with --vision-residency {residency}")
        residency = "cpu"
    if offload is not None:
        alias = "overlay" if offload == "on" else "resident"
        if residency not in (None, alias):
            raise ValueError(f"--vision-offload {offload} conflicts with --vision-residency {residency}")
        residency = alias
    if residency is not None and not vision:
        raise ValueError("--vision-residency requires --vision")
    return MediaOptions(
        vision=vision, residency=residency or "resident", max_merged=getattr(a, "vision_max_merged", None),
        cache_mib=getattr(a, "media_cache_mib", 1024), live_mib=getattr(a, "media_live_mib", 2048),
        preprocess_threads=getattr(a, "media_preprocess_threads", 0),
        lenient_image_detail=bool(getattr(a, "lenient_image_detail", False)),
        fetch_timeout_s=float(getattr(a, "media_fetch_timeout_s", 30.0)))
