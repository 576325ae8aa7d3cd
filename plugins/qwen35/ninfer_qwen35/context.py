"""The explicit forward context: which sequences a forward covers and where their caches live."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Segment:
    """One sequence's run of new tokens inside a flattened forward batch."""

    slot: int
    pages: list[int]
    start: int  # position of the first new token (= tokens already cached)
    length: int  # new tokens
    offset: int  # row of the first new token in the flattened batch


@dataclass
class CacheTensors:
    """Per-layer cache storage, owned by the runner.

    kv[layer] = (K, V), each [num_pages, page_size, kv_heads, head_dim] in the model dtype;
    conv[layer] = [num_slots, conv_dim, kernel - 1] in the model dtype;
    ssm[layer] = [num_slots, Hv, dk, dv] in fp32.
    """

    page_size: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardContext:
    segments: list[Segment]
    positions: torch.Tensor  # [N] int64, absolute position of every new token
    cache: CacheTensors
    cos: torch.Tensor | None = None  # [N, rotary_dim]
    sin: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one token (the batched single-step paths apply)."""
        return all(s.length == 1 for s in self.segments)

    @property
    def slots(self) -> list[int]:
        return [s.slot for s in self.segments]

    @classmethod
    def build(cls, segments: list[Segment], cache: CacheTensors, device) -> ForwardContext:
        pos = torch.cat([torch.arange(s.start, s.start + s.length, dtype=torch.int64) for s in segments]).to(
            device
        )
        return cls(segments=segments, positions=pos, cache=cache)
