"""ExampleRunner: the model-family contract (ninfer_core.engine.model_api) on a toy model.

One attention layer over paged KV and a recurrent layer with one vector of state per lane:
    x_t = E[token_t]                                   # [hidden]
    s_t = decay * s_{t-1} + x_t                        # the state slot holds s of the lane's last token
    h_t = x_t + attention(x_t W_q; keys x_j W_k, values x_j W_v, j <= t) + s_t
    logits_t = h_t E^T                                 # tied head, fp32
Small enough to read in one sitting, yet it has what makes a real family's contract work: KV rows
that live in pages a table maps, state that cannot be truncated (a verify keeps the state of every
position so `commit` can roll back), and a state image for checkpoints.
"""

from __future__ import annotations

import math

import torch

from ninfer_core.engine.model_api import (
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    PAGE_SIZE,
    PREFILL,
    VERIFY,
    CacheSpec,
    ForwardBatch,
    KVGroup,
    ModelInfo,
    ModelRunner,
    RunnerOptions,
    SegmentOutput,
    StateImage,
    check_batch,
)

GROUP = "attn"


class ExampleRunner(ModelRunner):
    def __init__(self, weights: dict, config: dict, decay: float, eos_token_ids: tuple[int, ...] = ()):
        self.embed_w = weights["embed.weight"]  # [vocab, hidden]
        self.wq, self.wk, self.wv = (weights[f"attn.{n}.weight"] for n in "qkv")  # [hidden, hidden]
        self.decay = float(decay)
        vocab, hidden = self.embed_w.shape
        self.info = ModelInfo("example_lm", int(vocab), int(config.get("max_position_embeddings", 4096)),
                              int(hidden), eos_token_ids=eos_token_ids, n_params=sum(w.numel() for w in weights.values()))
        self.device = torch.device("cpu")
        self.k = self.v = self.state = None
        self.kv_dtype = torch.float32  # `--kv-dtype` (RunnerOptions.kv_dtype) may ask for another
        self._uncommitted: dict[int, torch.Tensor] = {}  # slot -> state after each verify position [T, hidden]

    # -- geometry and cache ---------------------------------------------------------------------
    def configure(self, options: RunnerOptions) -> None:
        fmt = options.kv_dtype  # a registered KV format (`ninfer_register_kv_dtypes`), or None
        if fmt is not None:
            dtype = getattr(torch, getattr(fmt, "torch_dtype", ""), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"the example family cannot store KV as {getattr(fmt, 'name', fmt)!r}")
            self.kv_dtype = dtype

    def cache_spec(self) -> CacheSpec:
        h, kv = self.info.hidden_size, self.kv_dtype.itemsize
        return CacheSpec(kv_groups=(KVGroup(GROUP, (0,), kv_heads=1, head_dim=h, bytes_per_token=2 * h * kv),),
                         state_bytes=h * 4, state_layers=(1,))

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        h = self.info.hidden_size
        self.page_size = page_size
        self.k = torch.zeros(num_pages, page_size, h, dtype=self.kv_dtype)  # [page, row, hidden]
        self.v = torch.zeros(num_pages, page_size, h, dtype=self.kv_dtype)
        self.state = torch.zeros(num_slots, h)  # [slot, hidden]
        self._uncommitted = {}

    def free_cache(self) -> None:
        self.k = self.v = self.state = None
        self._uncommitted = {}

    def kv_page_tensors(self) -> tuple:
        return () if self.k is None else (self.k, self.v)

    def reset_slot(self, slot: int) -> None:
        self._uncommitted.pop(slot, None)
        self.state[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        self._uncommitted.pop(dst, None)
        self.state[dst] = self.state[src]

    def copy_page(self, src: int, dst: int) -> None:
        self.k[dst], self.v[dst] = self.k[src], self.v[src]

    def capture_state(self, slot: int) -> StateImage:
        return StateImage({"sum": self.state[slot].clone()})

    def restore_state(self, image: StateImage, slot: int) -> None:
        s = image.tensors.get("sum")
        if s is None or tuple(s.shape) != (self.info.hidden_size,):
            raise ValueError("the StateImage is not an example-family state")
        self._uncommitted.pop(slot, None)
        self.state[slot] = s

    def read_pages(self, pages):
        idx = torch.tensor(list(pages), dtype=torch.long)
        return {"k": self.k[idx].clone(), "v": self.v[idx].clone()}

    def write_pages(self, pages, data) -> None:
        idx = torch.tensor(list(pages), dtype=torch.long)
        self.k[idx], self.v[idx] = data["k"], data["v"]

    # -- forwards -------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        check_batch(batch, self.info.vocab_size, self.state.shape[0], self.k.shape[0], (GROUP,), self.page_size)
        pending = [s.slot for s in batch.segments if s.slot in self._uncommitted]
        if pending:
            raise RuntimeError(f"state slots {pending} have an uncommitted verify (call commit first)")
        # Lanes are independent here, so each runs alone: batch invariance holds by construction.
        return [self._segment(seg) for seg in batch.segments]

    def _segment(self, seg) -> SegmentOutput:
        ps = self.page_size
        ids = torch.tensor([int(t) for t in seg.tokens], dtype=torch.long)
        x = self.embed_w[ids]  # [T, hidden]
        table = torch.tensor(list(seg.tables[GROUP]), dtype=torch.long)
        pos = torch.arange(seg.start, seg.end)
        self.k[table[pos // ps], pos % ps] = (x @ self.wk).to(self.kv_dtype)
        self.v[table[pos // ps], pos % ps] = (x @ self.wv).to(self.kv_dtype)
        every = torch.arange(seg.end)
        # every key and value read back from the pages (in fp32), the new ones included
        keys = self.k[table[every // ps], every % ps].float()  # [end, hidden]
        values = self.v[table[every // ps], every % ps].float()
        scores = (x @ self.wq) @ keys.T / math.sqrt(self.info.hidden_size)  # [T, end]
        scores = scores.masked_fill(every[None, :] > pos[:, None], float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ values
        states, s = [], self.state[seg.slot]
        for t in range(len(ids)):
            s = self.decay * s + x[t]
            states.append(s)
        states = torch.stack(states)  # [T, hidden]: the state after each position
        self.state[seg.slot] = states[-1]
        if seg.kind == VERIFY:
            self._uncommitted[seg.slot] = states
        if seg.snapshot is not None and seg.kind == PREFILL:
            at, snap_slot = seg.snapshot
            self.state[snap_slot] = states[at - 1]
        h = x + attn + states
        out = SegmentOutput()
        if seg.logits == LOGITS_ALL:
            out.logits = self.logits(h)
        elif seg.logits == LOGITS_LAST:
            out.logits = self.logits(h[-1:])[0]
        if FINAL_HIDDEN in seg.hidden:
            out.hidden[FINAL_HIDDEN] = h
        return out

    def commit(self, kept) -> None:
        for slot, n in kept:
            states = self._uncommitted.pop(slot, None)
            if states is None:
                raise RuntimeError(f"state slot {slot} has no verify to commit")
            if not 1 <= n <= len(states):
                raise ValueError(f"commit of {n} tokens of a verify of {len(states)}")
            self.state[slot] = states[n - 1]

    def embed(self, token_ids):
        return self.embed_w[torch.as_tensor(token_ids, dtype=torch.long)]

    def logits(self, hidden):
        return (hidden @ self.embed_w.T).float()
