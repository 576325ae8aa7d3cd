"""The MTP head as a draft head over the paged cache (torch reference path).

Position convention (the one `ninfer_core.nn.mtp` and the trained heads use): the head's row at
position p reads token p and the target's final hidden at p-1, and predicts token p+1 from there
(the token after next of the target at p-1). Position 0 has no row: its page row stays unused and
every head query attends to keys 1.. only.

Cache: the head's K/V live in the runner's pages under layer ids past the model's own
(`CacheTensors.kv[num_hidden_layers + i]`), so checkpoints, copy-on-write and slot files carry them
with the target's; the state slot keeps the target's final hidden at the lane's last position
(`CacheTensors.hidden`), so a lane resumed from a checkpoint can draft at once.

Every target forward "rides along": it writes the head's K/V rows of the positions it ran (a row's
K/V depend only on its own token and the previous hidden, so no head attention is needed for a
one-layer head), which keeps the head's cache in step with the target's, verify rows included: a
rejected draft's rows are simply overwritten by the next round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.engine.model_api import DraftHead, DraftStep, KVGroup
from ninfer_core.nn.attention import paged_rows_attention

KEY_START = 1  # the head has no key at position 0


class MtpDraftHead(DraftHead):
    name = "mtp"
    kv_group = "mtp"

    def __init__(self, runner):
        self.runner = runner
        self.head = runner.mtp
        cfg = runner.cfg
        self.hidden_size = cfg.hidden_size
        self.layer_ids = tuple(cfg.num_hidden_layers + i for i in range(len(self.head.layers)))

    def kv_group_spec(self, elem: int) -> KVGroup:
        cfg = self.runner.cfg
        return KVGroup(name=self.kv_group, layers=self.layer_ids, kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim,
                       bytes_per_token=2 * len(self.layer_ids) * cfg.num_key_value_heads * cfg.head_dim * elem)

    # -- shared pieces ---------------------------------------------------------------------------
    def fuse_inputs(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """fc(cat[norm(embed(token)), norm(prev hidden)]) -> [N, hidden]."""
        h = self.head
        emb = self.runner.model.embed_tokens(token_ids)
        x = torch.cat([h.pre_fc_norm_embedding(emb), h.pre_fc_norm_hidden(prev_hidden.to(emb.dtype))], -1)
        return h.fc(x)

    def _write(self, layer_id: int, k, v, pages, rows) -> None:
        kc, vc = self.runner.cache.kv[layer_id]
        kc[pages, rows] = k.to(kc.dtype)
        vc[pages, rows] = v.to(vc.dtype)

    # -- ride-along: the head's K/V of positions a target forward ran ------------------------------
    @torch.inference_mode()
    def write_rows(self, positions: torch.Tensor, tokens: torch.Tensor, prev_hidden: torch.Tensor,
                   pages: torch.Tensor, rows: torch.Tensor, tables: Sequence[Sequence[int]] | None = None) -> None:
        """K/V rows at `positions` [N] (all >= 1) from `tokens` [N] and the target hidden at each
        position - 1 [N, H]; written at (pages, rows). A head of several layers also needs each
        row's attention over the earlier rows: `tables` gives every row's page table."""
        if positions.numel() == 0:
            return
        x = self.fuse_inputs(tokens, prev_hidden)
        cos, sin = self.runner.model.rotary.cos_sin(positions, x.dtype)
        layers = self.head.layers
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, gate, k, v = attn.project(layer.input_layernorm(x), cos, sin)
            self._write(self.layer_ids[i], k, v, pages, rows)
            if i + 1 == len(layers):
                break
            lengths = (positions + 1).tolist()
            kc, vc = self.runner.cache.kv[self.layer_ids[i]]
            o = paged_rows_attention(q, kc, vc, tables, lengths, self.runner.cache.page_size, attn.scale, KEY_START)
            x = x + attn.finish(o.to(x.dtype), gate)
            x = x + layer.mlp(layer.post_attention_layernorm(x))

    # -- one draft position per lane ---------------------------------------------------------------
    def _check_rows(self, rows: Sequence[DraftStep]) -> None:
        r = self.runner
        if r.cache is None or r.cache.hidden is None:
            raise RuntimeError("the MTP head is not enabled (enable_draft_head before allocate_cache)")
        for row in rows:
            if not 1 <= row.position < r.cfg.max_position_embeddings:
                raise ValueError(f"draft position {row.position} outside 1..{r.cfg.max_position_embeddings - 1}")
            if not 0 <= row.token < r.cfg.vocab_size:
                raise ValueError(f"token id {row.token} outside the vocabulary")

    @torch.inference_mode()
    def step(self, rows: Sequence[DraftStep]) -> torch.Tensor:
        r = self.runner
        cache, ps, dev = r.cache, r.cache.page_size, r.device
        self._check_rows(rows)
        tokens = torch.tensor([row.token for row in rows], dtype=torch.int64, device=dev)
        pos = torch.tensor([row.position for row in rows], dtype=torch.int64, device=dev)
        prev = torch.stack([cache.hidden[row.slot] if row.prev_hidden is None else row.prev_hidden.to(cache.hidden.dtype)
                            for row in rows])
        wt = [row.write_table if row.write_table is not None else row.table for row in rows]
        wpage = torch.tensor([t[row.position // ps] for t, row in zip(wt, rows)], dtype=torch.int64, device=dev)
        wrow = pos % ps
        lengths = [row.kv_len if row.kv_len is not None else row.position + 1 for row in rows]
        tables = [list(row.table[: -(-n // ps)]) for row, n in zip(rows, lengths)]
        x = self.fuse_inputs(tokens, prev)
        cos, sin = r.model.rotary.cos_sin(pos, x.dtype)
        for i, layer in enumerate(self.head.layers):
            attn = layer.self_attn
            q, gate, k, v = attn.project(layer.input_layernorm(x), cos, sin)
            self._write(self.layer_ids[i], k, v, wpage, wrow)
            kc, vc = cache.kv[self.layer_ids[i]]
            o = paged_rows_attention(q, kc, vc, tables, lengths, ps, attn.scale, KEY_START)
            x = x + attn.finish(o.to(x.dtype), gate)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head.norm(x)
