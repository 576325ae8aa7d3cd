"""The model-family contract: what a family plugin gives the engine.

The engine owns bookkeeping (lanes, KV pages, state slots); the family owns tensors and forwards.
A family declares its cache geometry (`CacheSpec`); the engine sizes pools from it and hands the
family page ids and slot ids. Every forward has a torch reference path that runs on the CPU.

Paged KV: each attention layer keeps K and V as [num_pages, page_size, kv_heads, head_dim]; a
sequence's token at position p lives in page `pages[p // page_size]`, row `p % page_size`.
State slots: each recurrent layer keeps its conv and recurrent state per slot index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

PAGE_SIZE = 64


@dataclass(frozen=True)
class KVGroup:
    """Attention layers sharing one KV page geometry."""

    name: str
    layers: tuple[int, ...]  # model layer indices in this group
    kv_heads: int
    head_dim: int
    bytes_per_token: int  # K+V bytes of one token across all layers of the group
    window: int | None = None  # sliding window (pages outside it may be released); None = global


@dataclass(frozen=True)
class CacheSpec:
    kv_groups: tuple[KVGroup, ...]
    state_bytes: int  # bytes of one state slot (all recurrent layers: conv + recurrent state)
    state_layers: tuple[int, ...] = ()  # model layer indices holding recurrent state

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.kv_groups)


@dataclass
class SeqView:
    """One sequence as the model sees it in a forward.

    `pages` must cover positions [0, num_cached + len(new tokens)); `num_cached` tokens are
    already in the KV pages and folded into the state slot.
    """

    slot: int
    pages: list[int]
    num_cached: int


@dataclass
class StateImage:
    """The recurrent state of one sequence at an exact token frontier, outside any state slot.

    `tensors` maps a name (e.g. "conv.3", "ssm.3") to a Host tensor; `nbytes` is their size.
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


class ModelRunner(ABC):
    """A loaded model: owns weights and cache tensors on one device."""

    info: ModelInfo
    device: Any  # torch.device

    @abstractmethod
    def cache_spec(self) -> CacheSpec:
        """The KV and state geometry; the engine sizes its pools from it."""

    @abstractmethod
    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        """Allocate KV pages and state slots (called once by the engine before any forward)."""

    @abstractmethod
    def reset_slot(self, slot: int) -> None:
        """Zero a state slot so a new sequence can start at position 0 in it."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one state slot into another (a Device checkpoint's StateImage to a lane, and back)."""
        raise NotImplementedError

    # -- context cache (optional; a runner without these serves every request from root) -------
    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page of every attention layer (copy-on-write of a checkpoint's tail page)."""
        raise NotImplementedError

    def capture_state(self, slot: int) -> "StateImage":
        """A Host copy of a state slot: every recurrent layer's conv and recurrent state."""
        raise NotImplementedError

    def restore_state(self, image: "StateImage", slot: int) -> None:
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

    @abstractmethod
    def prefill(self, seq: SeqView, tokens: Sequence[int], all_logits: bool = False):
        """Run `tokens` at positions num_cached.. of `seq`; write their KV and advance its state.

        Returns fp32 logits: [vocab] for the last token, or [len(tokens), vocab] with all_logits.
        The caller advances `seq.num_cached` afterwards.
        """

    def prefill_with_snapshot(self, seq: SeqView, tokens: Sequence[int], at: int, slot: int):
        """`prefill`, and also leave in state slot `slot` the lane's state after the first `at`
        tokens (0 < at < len(tokens)): a checkpoint inside a chunk. This default runs two forwards
        around a `copy_slot`; a runner that can snapshot inside one forward overrides it."""
        if not 0 < at < len(tokens):
            raise ValueError(f"snapshot position {at} outside the chunk of {len(tokens)} tokens")
        self.prefill(SeqView(seq.slot, seq.pages, seq.num_cached), tokens[:at])
        self.copy_slot(seq.slot, slot)
        return self.prefill(SeqView(seq.slot, seq.pages, seq.num_cached + at), tokens[at:])

    @abstractmethod
    def decode(self, seqs: Sequence[SeqView], tokens: Sequence[int]):
        """One new token per sequence, all in one batched forward. Returns fp32 logits [B, vocab]."""


class ModelFamily(ABC):
    """Registered through `ninfer_register_model_families`; builds runners from artifacts."""

    name: str = ""

    @abstractmethod
    def load(self, artifact, device: str = "cpu", dtype: str | None = None) -> ModelRunner:
        """Build the model from an open `ninfer_core.artifact.Artifact` (weights memory-mapped)."""

    def convert_hf_config(self, hf_config: dict) -> dict:
        """The model config stored in the artifact manifest; HF's config.json is kept as is by default."""
        return hf_config
