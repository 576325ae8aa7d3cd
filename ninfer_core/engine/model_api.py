"""The model-family contract (v2): everything the engine calls on a family's runner.

The engine owns bookkeeping (lanes, KV pages, state slots, drafts); the family owns tensors and
forwards. A family declares its cache geometry (`CacheSpec`: KV layer groups and the state-slot
size); the engine sizes its pools from it and hands the runner page ids and slot ids.

One forward entry point, `ModelRunner.forward(ForwardBatch)`: per lane a `LaneSegment` (a prefill
chunk, a decode of one token, or a verify of k+1 tokens), the lane's page table for each KV layer
group, per-token side inputs, and what to return (logits of the last or of every position, hidden
states at chosen layers). Decode is a verify with k = 0 that needs no commit. After a forward with
verify segments, `commit` keeps each lane's accepted prefix: recurrent state ends exactly at the
accepted position, KV beyond it is ignored (the engine's length says where a lane ends).

Paged KV: a KV group keeps, per layer, K and V as [num_pages, page_size, kv_heads, head_dim]; a
lane's token at position p lives in page `table[p // page_size]`, row `p % page_size`. Every group
shares one page-id space today (the engine's one pool; `KVGroup.bytes_per_token` adds up), so a
checkpoint's pages cover every group at once, draft-head KV included.
State slots: each recurrent layer keeps its conv and recurrent state per slot index; a runner with
a draft head enabled also keeps there the final hidden state of the lane's last position.

Every forward has a torch reference path that runs on the CPU (`ninfer_core.testing.ToyRunner`
implements this contract without torch kernels; each family plugin's CPU runner is its
reference).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PAGE_SIZE = 64
FINAL_HIDDEN = -1  # hidden-state "layer" of the final-normed output (the input of the LM head)

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"
SEGMENT_KINDS = (PREFILL, DECODE, VERIFY)
LOGITS_LAST, LOGITS_ALL, LOGITS_NONE = "last", "all", "none"


@dataclass(frozen=True)
class KVGroup:
    """Attention layers sharing one KV page geometry."""

    name: str
    layers: tuple[int, ...]  # model layer indices in this group (draft-head layers count past the model's)
    kv_heads: int
    head_dim: int
    bytes_per_token: int  # K+V bytes of one token across all layers of the group
    window: int | None = None  # sliding window in tokens (pages outside it may be released); None = global
    page_size: int = PAGE_SIZE


@dataclass(frozen=True)
class CacheSpec:
    kv_groups: tuple[KVGroup, ...]
    state_bytes: int  # bytes of one state slot (recurrent conv + SSM state, draft-head hidden)
    state_layers: tuple[int, ...] = ()  # model layer indices holding recurrent state

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.kv_groups)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.kv_groups)


@dataclass
class SideInputs:
    """Per-token inputs beside the token ids, computed outside the family's forward.

    positions: None (start .. start+T-1), or int positions [T], or [3, T] multimodal (mRoPE)
    positions. embeddings: (row, tensor [n, hidden]) pairs spliced over the token embeddings of
    rows row..row+n-1 (media placeholders; their token ids may be identity ids >= vocab_size, which
    a runner must not look up). extras: family-defined per-token values.
    """

    positions: Any = None
    embeddings: list = field(default_factory=list)
    extras: dict = field(default_factory=dict)

    def covered_rows(self) -> set[int]:
        """Rows whose token embedding is replaced (their token ids may be media identity ids at
        or above the vocabulary: see ninfer_core.media.api)."""
        return {row + j for row, emb in self.embeddings for j in range(int(emb.shape[0]))}

    def slice(self, a: int, b: int) -> "SideInputs":
        """The side inputs of rows [a, b) of the segment (a runner splitting a segment)."""
        pos = self.positions
        if pos is not None:
            pos = pos[..., a:b]
        embs = []
        for row, emb in self.embeddings:
            lo, hi = max(row, a), min(row + int(emb.shape[0]), b)
            if lo < hi:
                embs.append((lo - a, emb[lo - row: hi - row]))
        return SideInputs(pos, embs, {k: v[..., a:b] if hasattr(v, "shape") else v for k, v in self.extras.items()})


@dataclass
class LaneSegment:
    """One lane's run of new tokens in a forward.

    `tables[group]` must cover positions [0, start + len(tokens)); `start` tokens are already in
    the lane's KV pages and folded into its state slot. `snapshot=(at, slot)` (prefill only) also
    leaves the lane's state after its first `at` tokens in state slot `slot` (a checkpoint inside
    the chunk, 0 < at < len(tokens)).
    """

    slot: int
    tables: Mapping[str, Sequence[int]]
    start: int
    tokens: Sequence[int]
    kind: str = PREFILL
    logits: str = LOGITS_LAST
    hidden: tuple[int, ...] = ()  # layer outputs to return (FINAL_HIDDEN: the final-normed state)
    snapshot: tuple[int, int] | None = None
    side: SideInputs | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class ForwardBatch:
    segments: list[LaneSegment]


@dataclass
class SegmentOutput:
    """logits: fp32 [vocab] (last) or [T, vocab] (all) or None; hidden: {layer: [T, hidden]}."""

    logits: Any = None
    hidden: dict = field(default_factory=dict)


@dataclass
class SeqView:
    """One lane as the convenience forwards (`prefill`, `decode`) see it: its state slot, the page
    ids of every KV group (one shared table) and the positions already cached."""

    slot: int
    pages: list[int]
    num_cached: int


@dataclass
class StateImage:
    """The continuation state of one lane at an exact token frontier, outside any state slot.

    `tensors` maps a name (e.g. "conv.3", "ssm.3", "hidden") to a Host tensor; `nbytes` is their size.
    """

    tensors: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel() * t.element_size()) for t in self.tensors.values())


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    vocab_size: int  # logits width
    max_position: int  # native context (n_ctx_train)
    hidden_size: int
    eos_token_ids: tuple[int, ...] = ()
    n_params: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class RunnerOptions:
    """Load-time switches the engine passes to `ModelRunner.configure`."""

    cuda_graph: bool = True
    verify_widths: tuple[int, ...] = ()  # k+1 widths a speculative backend verifies (graphs, warm-up)
    max_lanes: int = 1
    # the longest run of new tokens one lane brings to a forward (the engine's prefill chunk; 0:
    # not stated). A runner whose per-lane cache depends on it (a sliding-window ring) sizes by it.
    max_segment_tokens: int = 0
    # what `--kv-dtype` resolved to through `ninfer_register_kv_dtypes` (None: the runner's native
    # KV format). A runner that cannot store its KV in it refuses in `configure`.
    kv_dtype: Any = None


@dataclass
class DraftStep:
    """One lane's row of a draft-head step: the token at `position` and the hidden state it
    conditions on (the target's at position-1, or the head's own output of the previous step).

    `prev_hidden` None takes the target hidden the runner keeps in the lane's state slot (valid
    when `position` is the lane's frontier). `table` is the page table the head attends through
    (the lane's own, or a window of it); `write_table` says where its new KV row goes (default:
    `table`); `kv_len` the number of keys the row attends over in `table` (default position + 1).
    """

    slot: int
    position: int
    token: int
    table: Sequence[int]
    prev_hidden: Any = None
    write_table: Sequence[int] | None = None
    kv_len: int | None = None


class DraftHead(ABC):
    """A family's own draft layers (a multi-token-prediction block) as a speculative backend reaches them.

    Enabling a head (`ModelRunner.enable_draft_head`, before `allocate_cache`) adds its KV group to
    the cache spec and makes every target forward write the head's KV for the positions it runs
    (the head's KV at position p depends only on token p and the target's hidden at p-1), so the
    head's cache is always in step with the target's and checkpoints carry it.
    """

    name: str = ""
    kv_group: str = ""
    hidden_size: int = 0

    @abstractmethod
    def step(self, rows: Sequence[DraftStep]) -> Any:
        """One draft position per lane, batched: writes each row's KV and returns the head's
        final-normed hidden [len(rows), hidden] (feed it to `ModelRunner.logits`, or to a proposal
        head, and as `prev_hidden` of the next step)."""

    def chain(self, rows: Sequence[DraftStep], steps: int, pick) -> Any:
        """`steps` chained draft positions per lane: the first from `rows`, each next one position
        on, fed the previous step's pick and output hidden. `pick(hidden [B, H]) -> ids [B]` must
        be device tensor ops only (a family may run the whole chain as one CUDA Graph). Returns the
        picks [B, steps]. This default runs `step` `steps` times."""
        import torch

        out = []
        rows = list(rows)
        for j in range(steps):
            hidden = self.step(rows)
            ids = pick(hidden)
            out.append(ids)
            if j + 1 < steps:
                tok = ids.tolist()
                rows = [DraftStep(r.slot, r.position + 1, int(t), r.table, hidden[i], r.write_table,
                                  None if r.kv_len is None else r.kv_len + 1) for i, (r, t) in enumerate(zip(rows, tok))]
        return torch.stack(out, 1)


class ModelRunner(ABC):
    """A loaded model: owns weights and cache tensors on one device. Everything the engine calls."""

    info: ModelInfo
    device: Any  # torch.device

    # -- cache -----------------------------------------------------------------------------------
    @abstractmethod
    def cache_spec(self) -> CacheSpec:
        """The KV and state geometry; the engine sizes its pools from it."""

    @abstractmethod
    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        """Allocate KV pages and state slots (called once by the engine before any forward)."""

    @abstractmethod
    def reset_slot(self, slot: int) -> None:
        """Zero a state slot so a new lane can start at position 0 in it."""

    def free_cache(self) -> None:
        """Release the cache tensors (before a re-allocation, enabling a draft head, or a suspend)."""
        raise NotImplementedError

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one state slot into another (a Device checkpoint's StateImage to a lane, and back)."""
        raise NotImplementedError

    def kv_page_tensors(self) -> tuple:
        """Optional: every cache tensor indexed by KV page id on its first dimension (each over a
        storage of its own). A model suspend then copies only the pages in use; the others read as
        zeros after the resume. Empty (the default): the cache is copied whole."""
        return ()

    def evictable_weights(self) -> tuple:
        """Optional: the weight tensors an exclusive overlay window may borrow while it is open and
        restore after (spec "Vision residency"), in eviction order: the output head, the token
        embedding, the draft and MTP heads. Empty (the default): the window falls back to the
        device allocator."""
        return ()

    # -- context cache (optional; a runner without these serves every request from root) ---------
    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page of every KV group (copy-on-write of a checkpoint's tail page)."""
        raise NotImplementedError

    def capture_state(self, slot: int) -> StateImage:
        """A Host copy of a state slot: everything the lane's continuation needs besides its KV."""
        raise NotImplementedError

    def restore_state(self, image: StateImage, slot: int) -> None:
        """Write a StateImage back into a state slot (exactly what `capture_state` read)."""
        raise NotImplementedError

    def read_pages(self, pages: Sequence[int]) -> dict[str, Any]:
        """Host copies of KV pages, {tensor name: tensor [len(pages), ...]} (slot files, Host KV)."""
        raise NotImplementedError

    def write_pages(self, pages: Sequence[int], data: dict[str, Any]) -> None:
        """Write what `read_pages` returned into (other) pages of the same geometry."""
        raise NotImplementedError

    @property
    def supports_context_cache(self) -> bool:
        """True when the runner implements copy_slot, copy_page and capture/restore_state."""
        cls = type(self)
        return all(getattr(cls, name) is not getattr(ModelRunner, name)
                   for name in ("copy_slot", "copy_page", "capture_state", "restore_state"))

    # -- forwards --------------------------------------------------------------------------------
    @abstractmethod
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        """Run every segment, write its KV, advance its state slot; one output per segment.

        Verify segments advance their slots provisionally: call `commit` for every one of them
        before the next forward that touches those slots.
        """

    def commit(self, kept: Sequence[tuple[int, int]]) -> None:
        """(slot, n) per lane of the last forward's verify segments: keep its first n tokens
        (1 <= n <= the segment's length), so the recurrent state ends after them exactly."""
        raise NotImplementedError

    def embed(self, token_ids) -> Any:
        """The target's token embeddings [T, hidden] (drafters that share them)."""
        raise NotImplementedError

    def logits(self, hidden) -> Any:
        """fp32 logits [T, vocab] of final-normed hidden states (the shared LM head)."""
        raise NotImplementedError

    # -- draft heads and options -----------------------------------------------------------------
    def draft_heads(self) -> tuple[str, ...]:
        """Names of the draft heads this artifact carries (e.g. ("mtp",))."""
        return ()

    def enable_draft_head(self, name: str) -> DraftHead:
        """Turn a draft head on (before `allocate_cache`): its KV joins the cache spec."""
        raise ValueError(f"this model has no draft head {name!r}")

    def counters(self) -> dict:
        """Family-defined counter blocks since load, {block name: {counter: value}} (GET /stats lists
        each block under its name, e.g. host-resident experts' hits); {} by default."""
        return {}

    def configure(self, options: RunnerOptions) -> None:
        """Load-time switches (CUDA Graphs, the verify widths to prepare); before allocate_cache."""

    # True when media rows attend to each other within their item (a bidirectional block), so a
    # forward must hold a media span whole: the engine never ends a prefill chunk inside one
    # (a chunk starting inside a span, after a reused prefix, runs to its end).
    whole_media_spans: bool = False

    @property
    def launches_async(self) -> bool:
        """True when a forward only queues device work (CUDA): the engine then hands the previous
        round's events to the server while the device computes."""
        return getattr(getattr(self, "device", None), "type", "cpu") == "cuda"

    # -- conveniences over `forward` (tools, tests, benches; the engine calls `forward`) ----------
    def _tables(self, pages: Sequence[int]) -> dict[str, Sequence[int]]:
        return {name: pages for name in self.cache_spec().group_names} or {"": pages}

    def prefill(self, seq: SeqView, tokens: Sequence[int], all_logits: bool = False):
        """Run `tokens` at positions num_cached.. of `seq`: fp32 logits [vocab] of the last token,
        or [len(tokens), vocab] with all_logits. The caller advances `seq.num_cached`."""
        seg = LaneSegment(seq.slot, self._tables(seq.pages), seq.num_cached, list(tokens), PREFILL,
                          LOGITS_ALL if all_logits else LOGITS_LAST)
        return self.forward(ForwardBatch([seg]))[0].logits

    def prefill_with_snapshot(self, seq: SeqView, tokens: Sequence[int], at: int, slot: int):
        """`prefill`, also leaving in state slot `slot` the state after the first `at` tokens."""
        seg = LaneSegment(seq.slot, self._tables(seq.pages), seq.num_cached, list(tokens), PREFILL,
                          snapshot=(at, slot))
        return self.forward(ForwardBatch([seg]))[0].logits

    def decode(self, seqs: Sequence[SeqView], tokens: Sequence[int]):
        """One new token per lane, all in one batched forward: fp32 logits [B, vocab]."""
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError(f"decode needs one token per sequence (got {len(seqs)} sequences, "
                             f"{len(tokens)} tokens)")
        out = self.forward(ForwardBatch([LaneSegment(s.slot, self._tables(s.pages), s.num_cached, [int(t)],
                                                     DECODE) for s, t in zip(seqs, tokens)]))
        import torch

        return torch.stack([o.logits for o in out])

    def forward_hidden(self, seqs: Sequence[SeqView], tokens: Sequence[Sequence[int]]):
        """Final-normed hidden states [sum(T), hidden] of a prefill over several lanes."""
        out = self.forward(ForwardBatch([LaneSegment(s.slot, self._tables(s.pages), s.num_cached, list(t),
                                                     PREFILL, LOGITS_NONE, (FINAL_HIDDEN,))
                                         for s, t in zip(seqs, tokens)]))
        import torch

        return torch.cat([o.hidden[FINAL_HIDDEN] for o in out])


class StageRunner(ABC):
    """One pipeline stage of a family's model (`ModelFamily.load_stage`): a `ModelRunner` over a
    contiguous range of the decoder layers that also implements `forward_stage`.

    Its cache methods cover its own layers: `cache_spec()` lists the KV groups and state of those
    layers (the same group names as the whole model's), `allocate_cache` sizes every layer it holds
    for the engine's whole page-id space and slot count, and StateImage / `read_pages` tensor names
    are keyed by the model's layer index, so the images of all stages merge into one image of the
    whole model without a clash (ninfer_core.engine.pipeline).

    `stage_width` (optional, default the hidden size): the columns of what a stage before the last
    returns and the next receives, when a family carries more than the residual stream between
    stages (per-row inputs every layer reads); the same on every stage of a model.
    """

    @abstractmethod
    def forward_stage(self, batch: ForwardBatch, hidden: Any = None) -> Any:
        """The stage's part of `forward(batch)`: the first stage takes `hidden` None and embeds the
        batch's tokens (side embeddings spliced in), every later stage takes the residual stream
        [sum(T), hidden] the previous stage returned; a stage before the last returns the residual
        stream after its last layer (the model's dtype, rows in segment order), the last stage
        returns the SegmentOutputs (logits, FINAL_HIDDEN) exactly as `forward` would. Verify
        segments advance the stage's slots provisionally, as `forward`'s do, until `commit`."""


def check_batch(batch: ForwardBatch, vocab_size: int, num_slots: int, num_pages: int,
                groups: Sequence[str], page_size: int = PAGE_SIZE) -> None:
    """The checks every runner makes before a forward (ValueError with what is wrong)."""
    if not batch.segments:
        raise ValueError("a forward needs at least one segment")
    slots = [s.slot for s in batch.segments]
    if len(set(slots)) != len(slots):
        raise ValueError("a forward batch holds the same state slot twice")
    for seg in batch.segments:
        if seg.kind not in SEGMENT_KINDS:
            raise ValueError(f"unknown segment kind {seg.kind!r}")
        if not seg.tokens:
            raise ValueError("a segment needs at least one token")
        if seg.kind == DECODE and len(seg.tokens) != 1:
            raise ValueError(f"a decode segment has one token, got {len(seg.tokens)}")
        if seg.logits not in (LOGITS_LAST, LOGITS_ALL, LOGITS_NONE):
            raise ValueError(f"unknown logits selection {seg.logits!r}")
        if not 0 <= seg.slot < num_slots:
            raise ValueError(f"state slot {seg.slot} outside 0..{num_slots - 1}")
        covered = seg.side.covered_rows() if seg.side is not None and seg.side.embeddings else ()
        for row, t in enumerate(seg.tokens):
            if not 0 <= int(t) < vocab_size and not (row in covered and int(t) >= 0):
                raise ValueError(f"token id {t} outside the vocabulary (size {vocab_size})")
        need = -(-seg.end // page_size)
        for g in groups:
            table = seg.tables.get(g)
            if table is None:
                raise ValueError(f"segment has no page table for KV group {g!r}")
            if len(table) < need:
                raise ValueError(f"sequence needs {need} pages for {seg.end} positions, has {len(table)}")
            bad = [p for p in table[:need] if not 0 <= p < num_pages]
            if bad:
                raise ValueError(f"page ids {bad} outside the pool of {num_pages} pages")
        if seg.snapshot is not None:
            at, snap_slot = seg.snapshot
            if seg.kind != PREFILL or not 0 < at < len(seg.tokens):
                raise ValueError(f"snapshot position {at} outside the chunk of {len(seg.tokens)} tokens")
            if not 0 <= snap_slot < num_slots or snap_slot == seg.slot:
                raise ValueError(f"snapshot slot {snap_slot} is not another state slot")


class ModelFamily(ABC):
    """Registered through `ninfer_register_model_families`; builds runners from artifacts."""

    name: str = ""

    @abstractmethod
    def load(self, artifact, device: str = "cpu", dtype: str | None = None, options: Any = None) -> ModelRunner:
        """Build the model from an open `ninfer_core.artifact.Artifact` (weights memory-mapped).

        `options` holds the serve options the family's plugin added (`ninfer_add_serve_options`)."""

    def convert_hf_config(self, hf_config: dict) -> dict:
        """The model config stored in the artifact manifest; HF's config.json is kept as is by default."""
        return hf_config

    # -- vision (optional; see ninfer_core.media.api) ----------------------------------------------
    def media_processor(self, artifact) -> Any:
        """The artifact's `MediaProcessor` (placeholder ids, patch input), or None without a tower."""
        return None

    def vision_tower(self, artifact, device: str, dtype: Any) -> Any:
        """A `VisionTower` over the artifact's vision component, its weights on `device` in `dtype`
        (a vision residency picks both)."""
        raise ValueError("this model family has no vision tower")

    def sampling_presets(self, architecture: str) -> dict | None:
        """The family's sampler presets {"thinking": {...}, "non_thinking": {...}}, or None for core's."""
        return None

    # -- pipeline stages (optional: `--devices A,B,...`; ninfer_core.engine.pipeline) -------------
    def pipeline_layers(self, artifact) -> int:
        """The number of decoder layers a pipeline split divides between stages; 0 (the default):
        this family cannot run as pipeline stages."""
        return 0

    def pipeline_cuts(self, artifact) -> Sequence[int] | None:
        """The layers a pipeline stage may start at (a stage never reads another stage's cache:
        e.g. layers that attend over an earlier layer's K/V stay with it); None (the default): any."""
        return None

    def load_stage(self, artifact, layers: range, device: str = "cpu", dtype: str | None = None,
                   options: Any = None) -> StageRunner:
        """A `StageRunner` holding the decoder layers `layers` (a sub-range of
        range(pipeline_layers)); the stage with layer 0 also holds the embeddings, the stage
        with the last layer the final norm and the LM head. Called in the stage's own process."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} family has no pipeline stages")
