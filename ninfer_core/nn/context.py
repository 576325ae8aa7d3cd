"""The explicit forward context: which lanes a forward covers and where their caches live."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROWS_KINDS = ("decode", "verify")  # segments whose tokens run as separate queries, one step at a time


@dataclass
class Segment:
    """One lane's run of new tokens inside a flattened forward batch."""

    slot: int
    pages: list[int]
    start: int  # position of the first new token (= tokens already cached)
    length: int  # new tokens
    offset: int  # row of the first new token in the flattened batch
    kind: str = "prefill"  # prefill (chunked math) | decode | verify (one recurrent step per token)

    @property
    def stepwise(self) -> bool:
        return self.kind in ROWS_KINDS


@dataclass
class CacheTensors:
    """Per-layer cache storage, owned by the runner.

    kv[layer] = (K, V), each [num_pages, page_size, kv_heads, head_dim] in the model dtype (draft
    head layers are keyed past the model's layers); conv[layer] = [num_slots, conv_dim, kernel - 1]
    in the model dtype; ssm[layer] = [num_slots, Hv, dk, dv] in fp32; hidden = [num_slots, hidden]
    (the final hidden of each lane's last position, kept while a draft head is enabled) or None.
    """

    page_size: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # quantised --kv-dtype layers: {layer: (K scales, V scales)} [num_pages, page_size, kv_heads] fp32
    # (a side stored in the model dtype has None); `kv_format` is the ninfer_core.quant.kv.KVFormat
    kv_scale: dict[int, tuple] = field(default_factory=dict)
    kv_format: object = None
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None

    def kv_views(self, layer: int, dtype):
        """(K, V) pages of `layer` as the reference attention reads them (dequantised on gather)."""
        k, v = self.kv[layer]
        scales = self.kv_scale.get(layer)
        if scales is None:
            return k, v
        from ninfer_core.quant.kv import page_views

        return page_views(self.kv_format, k, v, scales[0], scales[1], dtype)

    def write_kv(self, layer: int, page_t, row_t, k, v) -> None:
        kc, vc = self.kv[layer]
        scales = self.kv_scale.get(layer)
        if scales is None:
            kc[page_t, row_t] = k.to(kc.dtype)
            vc[page_t, row_t] = v.to(vc.dtype)
            return
        from ninfer_core.quant.kv import write_rows

        write_rows(self.kv_format, kc, vc, scales[0], scales[1], page_t, row_t, k, v)

    def page_tensors(self) -> dict:
        """Every per-page tensor by its page-data name: "k.3", "v.3", and "ks.3", "vs.3" (scales)."""
        out = {}
        for i, (k, v) in self.kv.items():
            out[f"k.{i}"], out[f"v.{i}"] = k, v
            ks, vs = self.kv_scale.get(i, (None, None))
            if ks is not None:
                out[f"ks.{i}"] = ks
            if vs is not None:
                out[f"vs.{i}"] = vs
        return out

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor by its StateImage name."""
        out = {f"conv.{i}": t for i, t in self.conv.items()}
        out.update({f"ssm.{i}": t for i, t in self.ssm.items()})
        if self.hidden is not None:
            out["hidden"] = self.hidden
        return out


@dataclass
class ForwardContext:
    segments: list[Segment]
    positions: torch.Tensor  # [N] int64, absolute position of every new token
    cache: CacheTensors
    cos: torch.Tensor | None = None  # [N, rotary_dim]
    rope_positions: torch.Tensor | None = None  # [3, N] multimodal (mRoPE) positions; None: `positions`
    sin: torch.Tensor | None = None
    # verify segments: {slot: {layer: (conv states [T, ...], ssm states [T, ...])}}, the state after
    # each of the segment's tokens, so `commit` can keep any prefix
    verify_states: dict = field(default_factory=dict)
    layer_outputs: dict = field(default_factory=dict)  # {layer: [N, hidden]} asked for by the caller

    @property
    def is_decode(self) -> bool:
        """Every lane contributes exactly one token (the batched single-step paths apply)."""
        return all(s.length == 1 for s in self.segments)

    @property
    def all_stepwise(self) -> bool:
        return all(s.stepwise for s in self.segments)

    @property
    def slots(self) -> list[int]:
        return [s.slot for s in self.segments]

    @classmethod
    def build(cls, segments: list[Segment], cache: CacheTensors, device) -> ForwardContext:
        pos = torch.cat([torch.arange(s.start, s.start + s.length, dtype=torch.int64) for s in segments]).to(
            device
        )
        return cls(segments=segments, positions=pos, cache=cache)
