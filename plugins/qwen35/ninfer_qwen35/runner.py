"""Qwen35Runner: the ModelRunner of the Qwen3.5 family (cache ownership, prefill, batched decode)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.engine.model_api import (
    PAGE_SIZE,
    CacheSpec,
    KVGroup,
    ModelInfo,
    ModelRunner,
    SeqView,
    StateImage,
)
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.context import CacheTensors, ForwardContext, Segment
from ninfer_qwen35.model import Qwen35TextModel
from ninfer_qwen35.mtp import MtpHead


class Qwen35Runner(ModelRunner):
    def __init__(
        self,
        model: Qwen35TextModel,
        cfg: Qwen35Config,
        device: torch.device,
        dtype: torch.dtype,
        mtp: MtpHead | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.model, self.cfg, self.device, self.dtype, self.mtp = model, cfg, device, dtype, mtp
        self.cache: CacheTensors | None = None
        self.num_pages = self.num_slots = 0
        n_params = sum(p.numel() for p in model.parameters())
        self.info = ModelInfo(
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            hidden_size=cfg.hidden_size,
            eos_token_ids=tuple(eos_token_ids or cfg.eos_token_ids),
            n_params=n_params,
            extra={
                "dtype": str(dtype).removeprefix("torch."),
                "layer_types": list(cfg.layer_types),
                "moe": cfg.is_moe,
                "mtp": mtp is not None,
            },
        )

    # ---- cache geometry ---------------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        cfg = self.cfg
        elem = torch.empty((), dtype=self.dtype).element_size()
        attn_layers = cfg.full_attention_layers
        kv_bytes = 2 * len(attn_layers) * cfg.num_key_value_heads * cfg.head_dim * elem
        conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem
        ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        groups = ()
        if attn_layers:
            groups = (
                KVGroup(
                    name="full_attention",
                    layers=attn_layers,
                    kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim,
                    bytes_per_token=kv_bytes,
                ),
            )
        gdn_layers = cfg.linear_attention_layers
        return CacheSpec(
            kv_groups=groups, state_bytes=len(gdn_layers) * (conv + ssm), state_layers=gdn_layers
        )

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        cfg, dev = self.cfg, self.device
        cache = CacheTensors(page_size=page_size)
        for i in cfg.full_attention_layers:
            shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
            cache.kv[i] = (
                torch.zeros(shape, dtype=self.dtype, device=dev),
                torch.zeros(shape, dtype=self.dtype, device=dev),
            )
        for i in cfg.linear_attention_layers:
            conv_shape, ssm_shape = self.model.layers[i].linear_attn.state_shapes()
            cache.conv[i] = torch.zeros((num_slots, *conv_shape), dtype=self.dtype, device=dev)
            cache.ssm[i] = torch.zeros((num_slots, *ssm_shape), dtype=torch.float32, device=dev)
        self.cache, self.num_pages, self.num_slots = cache, num_pages, num_slots

    def reset_slot(self, slot: int) -> None:
        self._check_slot(slot)
        for t in (*self.cache.conv.values(), *self.cache.ssm.values()):
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)
        for t in (*self.cache.conv.values(), *self.cache.ssm.values()):
            t[dst].copy_(t[src])

    # ---- context cache: checkpoints' KV pages and StateImages ---------------------------------
    def copy_page(self, src: int, dst: int) -> None:
        for i in (src, dst):
            if not 0 <= i < self.num_pages:
                raise ValueError(f"page id {i} outside the pool of {self.num_pages} pages")
        for k, v in self.cache.kv.values():
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    # Host copies go to pinned memory (the spec's pinned Host tiers): every tensor's device-to-host
    # copy is queued without waiting and the stream is synchronised once, so an image of a large
    # model moves at the link's rate instead of one pageable round trip per layer tensor.
    def _to_host(self, tensors: dict) -> dict:
        if self.device.type != "cuda":
            return {name: t.to("cpu", copy=True) for name, t in tensors.items()}
        out = {}
        for name, t in tensors.items():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def capture_state(self, slot: int) -> StateImage:
        self._check_slot(slot)
        tensors = {f"conv.{i}": t[slot] for i, t in self.cache.conv.items()}
        tensors.update({f"ssm.{i}": t[slot] for i, t in self.cache.ssm.items()})
        return StateImage(self._to_host(tensors))

    def restore_state(self, image: StateImage, slot: int) -> None:
        self._check_slot(slot)
        pairs = []
        for kind, store in (("conv", self.cache.conv), ("ssm", self.cache.ssm)):
            for i, t in store.items():
                src = image.tensors.get(f"{kind}.{i}")
                if src is None or tuple(src.shape) != tuple(t[slot].shape) or src.dtype != t.dtype:
                    raise ValueError(f"StateImage does not fit this model's {kind} state of layer {i}")
                pairs.append((t[slot], src))
        for dst, src in pairs:  # pinned sources copy asynchronously, in stream order with the forward
            dst.copy_(src, non_blocking=True)

    def read_pages(self, pages):
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        sel = {}
        for i, (k, v) in self.cache.kv.items():
            sel[f"k.{i}"] = k.index_select(0, idx)
            sel[f"v.{i}"] = v.index_select(0, idx)
        return self._to_host(sel)

    def write_pages(self, pages, data) -> None:
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        for i, (k, v) in self.cache.kv.items():
            for name, dst in ((f"k.{i}", k), (f"v.{i}", v)):
                src = data.get(name)
                if src is None or tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.shape[0] != len(idx):
                    raise ValueError(f"KV data does not fit this model's pages ({name})")
                dst.index_copy_(0, idx, src.to(dst.device, dst.dtype, non_blocking=True))

    # ---- forwards ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: SeqView, tokens: Sequence[int], all_logits: bool = False):
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        seg = self._segment(seq, len(tokens), offset=0)
        hidden = self._forward([seg], list(tokens))
        return self.model.logits(hidden if all_logits else hidden[-1])

    @torch.inference_mode()
    def decode(self, seqs: Sequence[SeqView], tokens: Sequence[int]):
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError(
                f"decode needs one token per sequence (got {len(seqs)} sequences, {len(tokens)} tokens)"
            )
        segs = [self._segment(s, 1, offset=i) for i, s in enumerate(seqs)]
        if len({s.slot for s in segs}) != len(segs):
            raise ValueError("decode batch holds the same state slot twice")
        return self.model.logits(self._forward(segs, list(tokens)))

    @torch.inference_mode()
    def forward_hidden(self, seqs: Sequence[SeqView], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Varlen forward (e.g. verify k+1 tokens per lane): final hidden states [sum(T), H].

        Advances KV and state like prefill; callers turn rows into logits with `logits()`.
        """
        segs, off = [], 0
        for s, toks in zip(seqs, tokens):
            segs.append(self._segment(s, len(toks), offset=off))
            off += len(toks)
        return self._forward(segs, [t for toks in tokens for t in toks])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def _forward(self, segs: list[Segment], tokens: list[int]) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must be called before a forward")
        for t in tokens:
            if not 0 <= t < self.cfg.vocab_size:
                raise ValueError(f"token id {t} outside the vocabulary (size {self.cfg.vocab_size})")
        ctx = ForwardContext.build(segs, self.cache, self.device)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        return self.model(ids, ctx)

    def _segment(self, seq: SeqView, n_new: int, offset: int) -> Segment:
        self._check_slot(seq.slot)
        ps = self.cache.page_size
        need = -(-(seq.num_cached + n_new) // ps)
        if len(seq.pages) < need:
            raise ValueError(
                f"sequence needs {need} pages for {seq.num_cached + n_new} positions, has {len(seq.pages)}"
            )
        bad = [p for p in seq.pages[:need] if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad} outside the pool of {self.num_pages} pages")
        return Segment(
            slot=seq.slot, pages=list(seq.pages), start=seq.num_cached, length=n_new, offset=offset
        )

    def _check_slot(self, slot: int) -> None:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must be called first")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} outside 0..{self.num_slots - 1}")

    # ---- MTP head (reference; used by the MTP speculative backend later) ---------------------
    @torch.inference_mode()
    def mtp_forward(self, next_tokens: Sequence[int], target_hidden: torch.Tensor, start: int, past=None):
        """Run the MTP head for one sequence: fp32 logits [T, vocab], normed hidden, KV list.

        next_tokens[i] is the token at position start + i; target_hidden[i] is the target's
        final hidden state at position start + i - 1.
        """
        if self.mtp is None:
            raise RuntimeError("this artifact has no MTP head (mtp.* tensors)")
        ids = torch.tensor(list(next_tokens), dtype=torch.int64, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        hidden, present = self.mtp(
            self.model.embed_tokens(ids), target_hidden.to(self.dtype), pos, self.model.rotary, past
        )
        return self.model.logits(hidden), hidden, present
