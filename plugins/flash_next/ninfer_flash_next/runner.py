"""FlashNextRunner: the ModelRunner of Flash-Next (CPU reference path; the GPU runs it on CUDA).

The forward contract, verify/commit, the MTP draft head and the context cache are core's hybrid
runner's (`ninfer_core.engine.hybrid_runner.HybridRunner`); this family adds to its cache:
- KV pages: beside K and V, the indexer's raw keys of every full-attention layer
  ([num_pages, page_size, indexer_head_dim]), so checkpoints and slot files carry them;
- state slots: per PLE layer the n-gram context (last n - 1 token ids, EOS for a fresh lane) and
  the dilated convolution's input columns, beside each GDN layer's conv and recurrent state.
  Hyper-connection streams live only inside a forward: a lane's continuation is its KV pages plus
  this state, which `capture_state` / `restore_state` move as one StateImage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ninfer_core.engine.hybrid_runner import ATTN_GROUP, HybridRunner
from ninfer_core.engine.model_api import PAGE_SIZE, CacheSpec, KVGroup
from ninfer_core.nn.context import CacheTensors
from ninfer_flash_next.config import FlashNextConfig


@dataclass
class FlashCacheTensors(CacheTensors):
    index: dict[int, torch.Tensor] = field(default_factory=dict)  # [num_pages, page_size, d_index]
    ple_ctx: dict[int, torch.Tensor] = field(default_factory=dict)  # [num_slots, n - 1] int64
    ple_conv: dict[int, torch.Tensor] = field(default_factory=dict)  # [num_slots, hc*H, state columns]

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        out = super().slot_tensors()
        out.update({f"ple_ctx.{i}": t for i, t in self.ple_ctx.items()})
        out.update({f"ple_conv.{i}": t for i, t in self.ple_conv.items()})
        return out


class FlashNextRunner(HybridRunner):
    def __init__(self, model, fcfg: FlashNextConfig, device, dtype, mtp=None, eos_token_ids=(), extras=None):
        super().__init__(model, fcfg.base, device, dtype, mtp=mtp, eos_token_ids=eos_token_ids)
        self.fcfg = fcfg
        self.extras = extras or {}  # residency objects: {"experts": ..., "ngram": ...}
        self.info.extra.update({"hc_count": fcfg.hc_count, "indexer": fcfg.indexer is not None,
                                "ple_layers": list(fcfg.ple_layer_ids)})

    # ---- cache geometry ---------------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        spec = super().cache_spec()
        f, elem = self.fcfg, self._elem
        groups = list(spec.kv_groups)
        if f.indexer is not None and groups and groups[0].name == ATTN_GROUP:
            g = groups[0]
            groups[0] = KVGroup(name=g.name, layers=g.layers, kv_heads=g.kv_heads, head_dim=g.head_dim,
                                bytes_per_token=g.bytes_per_token + len(g.layers) * f.indexer[1] * elem,
                                window=g.window, page_size=g.page_size)
        ple = len(f.ple_layer_ids) * (f.ngram_context * 8 + f.hc_hidden * f.ple_conv_state * elem)
        return CacheSpec(kv_groups=tuple(groups), state_bytes=spec.state_bytes + ple, state_layers=spec.state_layers)

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        super().allocate_cache(num_pages, num_slots, page_size)
        old, f, dev = self.cache, self.fcfg, self.device
        cache = FlashCacheTensors(page_size=page_size, kv=old.kv, conv=old.conv, ssm=old.ssm, hidden=old.hidden)
        if f.indexer is not None:
            for i in self.cfg.full_attention_layers:
                cache.index[i] = torch.zeros((num_pages, page_size, f.indexer[1]), dtype=self.dtype, device=dev)
        for i in f.ple_layer_ids:
            cache.ple_ctx[i] = torch.full((num_slots, f.ngram_context), f.eos_token_id, dtype=torch.int64, device=dev)
            cache.ple_conv[i] = torch.zeros((num_slots, f.hc_hidden, f.ple_conv_state), dtype=self.dtype, device=dev)
        self.cache = cache

    def kv_page_tensors(self) -> tuple:
        if self.cache is None:
            return ()
        return super().kv_page_tensors() + tuple(self.cache.index.values())

    def reset_slot(self, slot: int) -> None:
        super().reset_slot(slot)
        for t in self.cache.ple_ctx.values():
            t[slot].fill_(self.fcfg.eos_token_id)  # a sequence start reads as EOS before it

    def copy_page(self, src: int, dst: int) -> None:
        super().copy_page(src, dst)
        for t in self.cache.index.values():
            t[dst].copy_(t[src])

    def read_pages(self, pages):
        out = super().read_pages(pages)
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        out.update(self._to_host({f"index.{i}": t.index_select(0, idx) for i, t in self.cache.index.items()}))
        return out

    def write_pages(self, pages, data) -> None:
        names = {f"index.{i}" for i in self.cache.index}
        if not names <= set(data):
            raise ValueError("KV data does not fit this model's pages (no indexer keys)")
        super().write_pages(pages, {k: v for k, v in data.items() if k not in names})
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        for i, dst in self.cache.index.items():
            src = data[f"index.{i}"]
            if tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.shape[0] != len(idx):
                raise ValueError(f"KV data does not fit this model's pages (index.{i})")
            dst.index_copy_(0, idx, src.to(dst.device, dst.dtype))

    # ---- verify -----------------------------------------------------------------------------
    def commit(self, kept: Sequence[tuple[int, int]]) -> None:
        for slot, n in kept:
            got = self._uncommitted.pop(slot, None)
            if got is None:
                raise RuntimeError(f"state slot {slot} has no verify to commit")
            states, rows = got
            if not 1 <= n <= rows.shape[0]:
                raise ValueError(f"commit of {n} tokens of a verify of {rows.shape[0]}")
            for key, (a, b) in states.items():
                if isinstance(key, tuple):  # ("ple", layer): n-gram context and PLE conv columns
                    self.cache.ple_ctx[key[1]][slot] = a[n - 1]
                    self.cache.ple_conv[key[1]][slot] = b[n - 1]
                else:
                    self.cache.conv[key][slot] = a[n - 1]
                    self.cache.ssm[key][slot] = b[n - 1]
            if self.cache.hidden is not None:
                self.cache.hidden[slot] = rows[n - 1]

    # ---- residency reports --------------------------------------------------------------------
    def counters(self) -> dict:
        """Family counter blocks: `experts` (host or disk residency) and `ngram_table` (after a read)."""
        out = {}
        ex = self.extras.get("expert_counters")
        if ex is not None:
            out["experts"] = ex.report()
        ng = self.extras.get("ngram_counters")
        if ng is not None and ng.batches:
            out["ngram_table"] = ng.report()
        return out

    def forward(self, batch):
        out = super().forward(batch)
        prof = self.extras.get("expert_profile")
        if prof is not None:
            prof.maybe_write()
        return out
