"""DFlashBackend / DFlash2Backend: K drafts per lane from one block-diffusion pass.

The backend asks every target forward for the drafter's `target_layer_ids` (`SpecBackend.target_layers`)
and keeps, per request, each draft layer's context K/V of the committed positions (`observe_target`,
one row of the `ContextStore`, projected for all lanes at once before the next draft pass). A round
(`propose`) runs one batched drafter pass over [last token, mask x K] per lane and takes the drafts
from the target's LM head: argmax per position (DFlash), or the candidate selector's path (DFlash2);
on CUDA that pass is a graph per (lane bucket, context width bucket, K) (`graphs.DraftGraphs`). Drafts are deterministic, so the engine's coupled verification is exact rejection
sampling for sampled requests (docs/speculative.md).

Positions a request reused from the context cache were never run by its forwards: their context
rows are absent and masked out (the drafter proposes without them; verification still decides).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from ninfer_core.engine.spec import DraftLane, Proposal, SpecBackend
from ninfer_spec_dflash.config import DrafterConfig, DrafterConfigError
from ninfer_spec_dflash.context import ContextStore
from ninfer_spec_dflash.graphs import DraftGraphs, graphs_wanted, width_bucket
from ninfer_spec_dflash.model import Drafter

log = logging.getLogger("ninfer.spec.dflash")

DEFAULT_DRAFTS = 7
PROPOSAL_WEIGHT, PROPOSAL_IDS = "mtp_proposal.weight", "mtp_proposal.token_ids"


class SpecOptionError(ValueError):
    """A DFlash option combination or artifact that cannot serve (startup error)."""


def load_drafter(artifact, kind: str, vocab_size: int, device, dtype) -> Drafter:
    """The artifact's `kind` component as a Drafter on `device` (SpecOptionError naming the fix)."""
    drafters = artifact.manifest.get("drafters") or {}
    names = artifact.tensor_names(kind)
    if kind not in drafters or not names:
        raise SpecOptionError(f"--spec {kind} needs an artifact with a {kind} component: add the drafter with "
                              f"ninfer convert SRC OUT --{kind} DRAFTER_DIR (a published {kind} checkpoint); "
                              f"this artifact's components: {', '.join(artifact.components) or 'none'}")
    try:
        cfg = DrafterConfig.from_hf(drafters[kind], kind)
    except DrafterConfigError as e:
        raise SpecOptionError(f"the artifact's {kind} drafter: {e}") from None
    with torch.device("meta"):
        model = Drafter(cfg, vocab_size)
    want = dict(model.state_dict())
    prefix = kind + "."
    state = {}
    for n in names:
        key = n.removeprefix(prefix)
        if key not in want:
            raise SpecOptionError(f"the artifact's {kind} drafter has a tensor {n} its config does not describe")
        t = artifact.get_tensor(n)
        if tuple(t.shape) != tuple(want[key].shape):
            raise SpecOptionError(f"the artifact's {kind} tensor {n} has shape {tuple(t.shape)}, "
                                  f"its config wants {tuple(want[key].shape)}")
        state[key] = t.to(device=device, dtype=dtype)
    missing = sorted(set(want) - set(state))
    if missing:
        raise SpecOptionError(f"the artifact's {kind} drafter lacks {len(missing)} tensors ({', '.join(missing[:3])}...)")
    model.load_state_dict(state, assign=True)
    return model.eval()


class DFlashBackend(SpecBackend):
    name = "dflash"

    def __init__(self, runner, drafter: Drafter, draft_tokens: int, proposal=None):
        self.runner = runner
        self.drafter = drafter
        self.cfg = drafter.c
        self.draft_tokens = draft_tokens
        self.target_layers = tuple(sorted(set(self.cfg.target_layer_ids)))
        self.proposal = proposal  # (weight [N, H], token ids [N]) or None
        self.device = runner.device
        self.dtype = next(drafter.parameters()).dtype
        c = self.cfg
        self.store = ContextStore(self._project, c.num_layers, c.num_kv_heads, c.head_dim, self.device, self.dtype)
        self.graphs = DraftGraphs(self._draft_body, self.store, self.device)

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def check_options(cls, options) -> None:
        if getattr(options, "lm_head_draft", False) and getattr(options, "full_draft_head", False):
            raise SpecOptionError("--lm-head-draft and --full-draft-head contradict each other; give one")
        for flag in ("adaptive_mtp", "mtp_attention_window"):
            if getattr(options, flag, None):
                raise SpecOptionError(f"--{flag.replace('_', '-')} is an MTP option; --spec {cls.name} does not take it")

    @classmethod
    def load(cls, runner, artifact, options=None) -> DFlashBackend:
        cls.check_options(options)
        info = runner.info
        dtype = getattr(runner, "dtype", None) or torch.float32
        drafter = load_drafter(artifact, cls.name, info.vocab_size, runner.device, dtype)
        c = drafter.c
        if c.hidden_size != info.hidden_size:
            raise SpecOptionError(f"the {cls.name} drafter's hidden_size {c.hidden_size} is not the model's "
                                  f"{info.hidden_size} (a drafter for another model?)")
        n_layers = len(info.extra.get("layer_types") or ()) or None
        if n_layers is not None and max(c.target_layer_ids) >= n_layers:
            raise SpecOptionError(f"the {cls.name} drafter reads target layers {list(c.target_layer_ids)}; the model "
                                  f"has {n_layers} layers")
        if not 0 <= c.mask_token_id < info.vocab_size:
            raise SpecOptionError(f"the {cls.name} drafter's mask_token_id {c.mask_token_id} is outside the "
                                  f"vocabulary ({info.vocab_size})")
        k = getattr(options, "draft_tokens", None) or min(DEFAULT_DRAFTS, c.block_size - 1)
        if k > c.block_size - 1:
            raise SpecOptionError(f"--draft-tokens {k} exceeds the {cls.name} drafter's block of {c.block_size} "
                                  f"(at most {c.block_size - 1} drafts)")
        proposal = None
        if not getattr(options, "full_draft_head", False) and artifact.has_tensor(PROPOSAL_WEIGHT):
            proposal = (artifact.get_tensor(PROPOSAL_WEIGHT).to(runner.device, dtype),
                        artifact.get_tensor(PROPOSAL_IDS).to(runner.device, torch.int64))
        if getattr(options, "lm_head_draft", False) and proposal is None:
            raise SpecOptionError("--lm-head-draft needs an artifact that stores a proposal head "
                                  "(ninfer convert --mtp-proposal-head N); this one has none")
        return cls(runner, drafter, k, proposal)

    def describe(self) -> dict:
        return {"backend": self.name, "draft_tokens": self.draft_tokens, "block_size": self.cfg.block_size,
                "draft_layers": self.cfg.num_layers, "target_layers": list(self.cfg.target_layer_ids),
                "draft_head": "proposal" if self.proposal is not None else "full",
                "proposal_rows": int(self.proposal[0].shape[0]) if self.proposal is not None else None}

    # -- context ---------------------------------------------------------------------------------
    def _project(self, feats: torch.Tensor, pos: torch.Tensor):
        """Each draft layer's context (K, V) rows of target features [N, L*H] at positions pos [N]."""
        return self.drafter.context_kv(self.drafter.context(feats), pos)

    @torch.inference_mode()
    def observe_target(self, request_id: str, start: int, hidden: Mapping[int, torch.Tensor]) -> None:
        # queued: a round's lanes (and a prefill chunk) are projected together before the next draft pass
        feats = torch.cat([hidden[i] for i in self.cfg.target_layer_ids], -1)  # [n, L*H]
        self.store.observe(request_id, start, feats)

    def lane_finished(self, request_id: str) -> None:
        self.store.release(request_id)

    def context_rows(self, request_id: str) -> dict | None:
        """The request's context K/V rows per draft layer and their valid flags (copies), or None."""
        with torch.inference_mode():
            self.store.flush()
        return self.store.rows_of(request_id)

    # -- drafting --------------------------------------------------------------------------------
    def _draft_body(self, rows: torch.Tensor, tokens: torch.Tensor, bases: torch.Tensor, width: int,
                    k: int) -> torch.Tensor:
        """Drafts [B, K] of lanes (store rows, last tokens, positions: int64 [B] on the device) whose
        context reads the store's first `width` positions; no host sync (a CUDA Graph's body)."""
        hidden = self._block(rows, tokens, bases, width, k)
        return self._pick(hidden, tokens)

    def _block(self, rows, tokens, bases, width: int, k: int) -> torch.Tensor:
        """The drafter's final-normed hidden [B, k + 1, H] of each lane's block [token, mask x k]."""
        c, dev, st = self.cfg, self.device, self.store
        b, s = rows.shape[0], k + 1
        ids = torch.cat([tokens[:, None], torch.full((b, k), c.mask_token_id, dtype=torch.int64, device=dev)], 1)
        x = self.runner.embed(ids.reshape(-1)).view(b, s, -1).to(self.dtype)
        pos = bases[:, None] + torch.arange(s, device=dev)
        ctx_kv = [(st.k[i][:, :width].index_select(0, rows), st.v[i][:, :width].index_select(0, rows))
                  for i in range(c.num_layers)]
        kidx = torch.arange(width, device=dev)
        valid = st.valid[:, :width].index_select(0, rows) & (kidx[None, :] < bases[:, None])  # [B, W]
        mask = torch.cat([valid[:, None, :].expand(b, s, width), torch.ones(b, s, s, dtype=torch.bool, device=dev)], -1)
        kpos = torch.cat([kidx.expand(b, width), pos], 1)
        return self.drafter(x, pos, ctx_kv, mask, kpos)

    def _lanes(self, lanes: Sequence[DraftLane]):
        self.store.flush()
        rows = [self.store.row(lane.request_id) for lane in lanes]
        width = width_bucket(max(lane.position for lane in lanes))
        self.store.ensure_cap(width)
        return rows, [int(lane.token) for lane in lanes], [int(lane.position) for lane in lanes], width

    @torch.inference_mode()
    def hidden_block(self, lanes: Sequence[DraftLane], k: int) -> torch.Tensor:
        """The block's hidden [B, k + 1, H] for the lanes, eagerly (the reference of the graph path)."""
        rows, tokens, bases, width = self._lanes(lanes)
        t = torch.tensor([rows, tokens, bases], dtype=torch.int64).to(self.device)
        return self._block(t[0], t[1], t[2], width, k)

    def _scores(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [..., V'] of final-normed rows and the token ids of their columns (None: all)."""
        if self.proposal is not None:
            w, ids = self.proposal
            return torch.nn.functional.linear(hidden.to(w.dtype), w).float(), ids
        return self.runner.logits(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1), None

    def _pick(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Drafts [B, K] of the block rows 1..K: each position's argmax."""
        scores, ids = self._scores(hidden[:, 1:])
        top = scores.argmax(-1)
        return top if ids is None else ids[top]

    @torch.inference_mode()
    def propose(self, lanes: Sequence[DraftLane]) -> list[Proposal]:
        out = [Proposal([]) for _ in lanes]
        active = [i for i, lane in enumerate(lanes) if lane.max_drafts > 0]
        if not active:
            return out
        sel = [lanes[i] for i in active]
        # every lane runs the same block (one batched pass, a CUDA Graph per lane and width bucket)
        # and keeps what it may verify
        rows, tokens, bases, width = self._lanes(sel)
        drafts = self.graphs.run(rows, tokens, bases, width, self.draft_tokens,
                                 static=graphs_wanted(self.runner)).tolist()
        for j, i in enumerate(active):
            out[i] = Proposal([int(t) for t in drafts[j][: lanes[i].max_drafts]])
        return out


class DFlash2Backend(DFlashBackend):
    name = "dflash2"

    def _pick(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Drafts [B, K]: the candidate selector's greedy path from each lane's last token `anchor` [B]."""
        rows = hidden[:, 1:]
        scores, ids = self._scores(rows)
        return self.drafter.candidate_selector.walk(rows, scores, anchor, ids)
