"""The media contract between core and a model family's vision support.

Core acquires media (data URIs, http(s) URLs), decodes it (pillow, PyAV), caches prepared payloads
by content digest and expands the chat template's placeholders; the family states how an image or
a video becomes patch input (`MediaProcessor`) and runs its tower (`VisionTower`). A vision
residency (`ninfer_register_vision_residencies`, `--vision-residency NAME`) decides where the
tower's weights live and where each encode runs.

Media tokens enter the prompt as *identity ids*: ids at or above the vocabulary derived from the
item's digest and the token's index in it. The context cache matches prompts token for token, so a
cached prefix is reused only by a prompt carrying the same media at the same place with the same
grid; the runner never embeds those ids, because the side inputs cover every one of them with the
item's embeddings.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

IMAGE, VIDEO = "image", "video"
DETAILS = ("auto", "low", "high")
IDENTITY_SPACE = 1 << 31  # identity ids are vocab_size + [0, IDENTITY_SPACE)


@dataclass(frozen=True)
class MediaRef:
    """One media content part as a protocol found it, before acquisition."""

    kind: str  # IMAGE | VIDEO
    url: str  # data: URI or http(s) URL
    detail: str = "auto"  # auto | low | high (images; video parts are auto)
    param: str | None = None  # the field path errors name, e.g. "messages.0.content.1.image_url.url"


@dataclass
class PreparedMedia:
    """One item's immutable patch input, shared by every request that sends the same bytes.

    `pixel_values` [patches, patch_dim] (the family's layout and dtype); `grid` the family's grid
    (e.g. (t, h, w) in patches); `tokens` the merged tokens the item takes in the prompt; `digest`
    SHA-256 of the acquired bytes plus modality and preparation key (detail). `extra` carries
    what the family's placeholder expansion needs besides the grid (a video's frame times).
    """

    kind: str
    digest: str
    pixel_values: Any
    grid: tuple[int, ...]
    tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        pv = self.pixel_values
        return int(pv.numel() * pv.element_size()) if pv is not None else 0


@dataclass
class MediaSpan:
    """Where an item's embeddings go in the expanded prompt: prompt rows [start, start + length)
    take the item's embedding rows [offset, offset + length) (a video's frame pairs are spans of
    their own, with the timestamp text between them)."""

    start: int
    length: int
    item: PreparedMedia
    offset: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class Expansion:
    """What a family's placeholder expansion returns: the prompt with every placeholder grown into
    its item's tokens (each media token still the placeholder id), the spans, and the rope
    positions of every token ([3, T] int64 for mRoPE, or None) with the offset of the positions of
    text after the prompt (position of index i >= T is i + position_delta on every axis)."""

    ids: list[int]
    spans: list[MediaSpan]
    positions: Any = None
    position_delta: int = 0


@dataclass
class MediaPrompt:
    """The media of one request, as the engine sees it (GenerationRequest.media)."""

    spans: list[MediaSpan]
    positions: Any = None  # [3, T] int64 tensor, or None
    position_delta: int = 0
    report: Any = None  # media.prompt.PrepareReport of the preparation (request log)

    @property
    def digests(self) -> list[str]:
        return [s.item.digest for s in self.spans]

    @property
    def items(self) -> list[PreparedMedia]:
        """Each item once, in prompt order."""
        seen, out = set(), []
        for s in self.spans:
            if id(s.item) not in seen:
                seen.add(id(s.item))
                out.append(s.item)
        return out


class MediaProcessor(ABC):
    """A family's preprocessing: decoded pixels -> patch input, placeholders -> media tokens."""

    # placeholder token ids the chat template writes, one per media part: {IMAGE: id, VIDEO: id}
    placeholder_ids: ClassVar[dict[str, int]] = {}
    # the most merged tokens one item may take (the tower's envelope); `--vision-max-merged` caps it
    max_merged_limit: int = 16384
    min_merged: int = 64  # the smallest bound this family can prepare an item at
    video_fps: float = 2.0
    video_max_frames: int = 64

    def item_bound(self, kind: str, detail: str, max_merged: int) -> int:
        """The merged-token bound of one item at `detail` under the server's bound (spec "Image
        detail"): low is the area of a 512 x 512 picture, auto and high the server's bound."""
        from ninfer_core.media.options import LOW_DETAIL_MERGED

        if kind == IMAGE and detail == "low":
            return min(LOW_DETAIL_MERGED, max_merged)
        return max_merged

    @abstractmethod
    def prepare_image(self, image: Any, max_merged: int) -> tuple[Any, tuple[int, ...], int]:
        """A PIL image (RGB) -> (pixel_values, grid, tokens) with tokens <= max_merged."""

    def prepare_video(self, frames: list, times: list[float], max_merged: int) -> tuple[Any, tuple[int, ...], int, dict]:
        """Sampled RGB frames at `times` seconds -> (pixel_values, grid, tokens, extra)."""
        raise NotImplementedError("this model family does not read video")

    @abstractmethod
    def expand(self, ids: list[int], items: list[PreparedMedia]) -> Expansion:
        """Grow the placeholders of `ids` (in order, one per item) into the items' tokens."""


class VisionTower(ABC):
    """A family's vision encoder over one device (built by `ModelFamily.vision_tower`)."""

    hidden_size: int = 0  # width of the embeddings (the text model's hidden size)

    @abstractmethod
    def encode(self, item: PreparedMedia) -> Any:
        """The item's embeddings [item.tokens, hidden_size] (on the tower's device)."""

    def device_bytes(self) -> int:
        """Device memory the tower's weights hold (0 on the host)."""
        return 0


@dataclass
class EncodeJob:
    """One encode as a residency prepared it on the engine's worker (`VisionResidency.open`).

    `run()` returns the embeddings. A job that is not `exclusive` runs on the engine's encoder
    thread (its own device stream) while other lanes keep decoding and the owning lane yields its
    prefill units; an exclusive one (its window borrowed memory the text model reads) runs on the
    worker with nothing else running. `stats`: facts `run` leaves for the request log (an overlay
    window's kind, times and bytes), or None."""

    run: Callable[[], Any]
    exclusive: bool = False
    stats: dict | None = None


class VisionResidency(ABC):
    """Where a tower lives and where its encodes run (`--vision-residency NAME`).

    `load` is called once after the runner is built; `open` on the engine's worker thread before
    the prefill unit that first needs an item's rows, and the job it returns runs beside decode
    (ninfer_core.engine.media_side.MediaEncodes); the embeddings are moved to the runner's device
    by the runner."""

    name: str = ""
    max_item_tokens: int = 0  # the most merged tokens one item takes (set at load from the media bound)

    @classmethod
    @abstractmethod
    def load(cls, family: Any, artifact: Any, runner: Any, options: Any) -> VisionResidency:
        """Build the tower for this residency."""

    @abstractmethod
    def encode(self, item: PreparedMedia) -> Any:
        """Embeddings [item.tokens, hidden] for one prepared item."""

    def open(self, item: PreparedMedia) -> EncodeJob:
        """The encode of `item` as a job (the default: `encode` beside other lanes' decode)."""
        return EncodeJob(lambda: self.encode(item))

    def attach(self, pool: Any, runner: Any, lock: Any = None) -> None:
        """Called once by the engine after its KV pool and the runner's cache exist (`pool` a
        `ninfer_core.engine.pages.PagePool`, `lock` the engine lock guarding it): a residency that
        borrows free KV pages for its encodes keeps them. The default ignores it."""

    def describe(self) -> dict:
        """Facts for server_start and /props: residency, device bytes."""
        return {"residency": self.name}
