"""MtpBackend: K chained drafts per round through a model family's MTP draft head.

Round: for every lane, the head runs at the lane's frontier (its last committed token and the
target's hidden kept in the lane's state slot) and proposes the next token (argmax of the shared
LM head, or of the artifact's proposal head); each further draft feeds the head its own output
hidden and the previous draft, one position on, K steps in all, batched over the lanes. The head's
K/V rows for the committed positions were written by the target forwards themselves (the draft
head contract in `ninfer_core.engine.model_api`), so the drafts attend over an exact history.

`--mtp-attention-window N`: each draft attends to the first page of keys and the newest pages
covering N keys before its query (the lane's page table rebound to those pages, the row counted
over them), so its read stays constant as the context grows; verification is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ninfer_core.engine.model_api import PAGE_SIZE, DraftHead, DraftStep
from ninfer_core.engine.spec import DraftLane, Proposal, RoundReport, SpecBackend
from ninfer_spec_mtp.adaptive import AdaptiveWidth
from ninfer_spec_mtp.proposal import ProposalHead

log = logging.getLogger("ninfer.spec.mtp")

DEFAULT_DRAFTS = 3


class SpecOptionError(ValueError):
    """An MTP option combination or artifact that cannot serve (startup error)."""


def check_options(options) -> None:
    """The option checks that need no model (called before the port is bound)."""
    k = getattr(options, "draft_tokens", None) or DEFAULT_DRAFTS
    min_p = getattr(options, "draft_min_p", 0.0) or 0.0
    if min_p and getattr(options, "lm_head_draft", False):
        raise SpecOptionError("--draft-min-p reads the draft probabilities of the full output head; "
                              "it cannot be used with --lm-head-draft")
    if getattr(options, "lm_head_draft", False) and getattr(options, "full_draft_head", False):
        raise SpecOptionError("--lm-head-draft and --full-draft-head contradict each other; give one")
    window = getattr(options, "mtp_attention_window", 0) or 0
    if window and window < k + 1:
        raise SpecOptionError(f"--mtp-attention-window {window} must be at least --draft-tokens + 1 = {k + 1}")


class MtpBackend(SpecBackend):
    name = "mtp"

    def __init__(self, runner, head, draft_tokens: int, proposal: ProposalHead | None = None,
                 window: int = 0, adaptive: bool = False, min_p: float = 0.0):
        self.runner = runner
        self.min_p = min_p
        self._probs: list = []  # --draft-min-p: each chain step's draft probabilities [B]
        self.head = head
        self.draft_tokens = draft_tokens
        self.proposal = proposal
        self.window = window
        self.adaptive = AdaptiveWidth(draft_tokens) if adaptive else None
        self.page_size = PAGE_SIZE

    @classmethod
    def check_options(cls, options) -> None:
        check_options(options)

    @classmethod
    def load(cls, runner, artifact, options=None) -> "MtpBackend":
        check_options(options)
        k = getattr(options, "draft_tokens", None) or DEFAULT_DRAFTS
        if "mtp" not in runner.draft_heads():
            raise SpecOptionError("--spec mtp needs an artifact with an MTP head (the checkpoint's mtp.* tensors, "
                                  "kept by ninfer convert); this one has none")
        head = runner.enable_draft_head("mtp")
        min_p = getattr(options, "draft_min_p", 0.0) or 0.0
        if min_p and type(head).chain is not DraftHead.chain:
            # the probabilities are read beside the picks, which a head that captures its chain in a
            # CUDA Graph cannot hand out; the spec names this option for Flash-Next's MTP
            raise SpecOptionError("--draft-min-p needs a draft head that runs its chain step by step "
                                  "(Flash-Next's MTP); this model's head runs the chain as one graph")
        proposal = None
        if not min_p and not getattr(options, "full_draft_head", False):  # min-p reads the full head's probabilities
            proposal = ProposalHead.from_artifact(artifact, runner.device, getattr(runner, "dtype", None))
        if getattr(options, "lm_head_draft", False) and proposal is None:
            raise SpecOptionError("--lm-head-draft needs an artifact that stores a proposal head "
                                  "(ninfer convert --mtp-proposal-head N); this one has none")
        return cls(runner, head, k, proposal, getattr(options, "mtp_attention_window", 0) or 0,
                   bool(getattr(options, "adaptive_mtp", False)), min_p)

    @property
    def verify_widths(self) -> tuple[int, ...]:
        if self.adaptive is not None:
            return tuple(w + 1 for w in self.adaptive.widths)
        return (self.draft_tokens + 1,)

    def describe(self) -> dict:
        return {"backend": self.name, "draft_tokens": self.draft_tokens, "draft_min_p": self.min_p,
                "draft_head": "proposal" if self.proposal is not None else "full",
                "proposal_rows": self.proposal.rows if self.proposal is not None else None,
                "attention_window": self.window, "adaptive": self.adaptive is not None}

    # -- drafting ------------------------------------------------------------------------------------
    def _window_start(self, lane: DraftLane) -> int:
        """The first page of the window: the one holding the newest N-th key before the round's first
        query (0 without a window, or when the window reaches back to the first page)."""
        if not self.window:
            return 0
        first = (lane.position - self.window) // self.page_size
        return first if first > 1 else 0

    def _tables(self, table: list[int], first: int, position: int, steps: int = 1):
        """(table the draft attends through, keys the first of `steps` rows counts) at `position`."""
        if not first:
            return table, None
        ps = self.page_size
        return table[:1] + table[first: (position + steps - 1) // ps + 1], ps + (position - first * ps + 1)

    @torch.inference_mode()
    def propose(self, lanes: Sequence[DraftLane]) -> list[Proposal]:
        out = [Proposal([]) for _ in lanes]
        active = [i for i, lane in enumerate(lanes) if lane.max_drafts > 0]
        if not active:
            return out
        # every lane drafts the same number of positions (one batched chain; a CUDA Graph on the GPU
        # path) and keeps what it may verify; positions past a lane's pages write the scratch page
        steps = max(lanes[i].max_drafts for i in active)
        rows = []
        for i in active:
            lane = lanes[i]
            full = list(lane.tables[self.head.kv_group] if self.head.kv_group in lane.tables
                        else next(iter(lane.tables.values())))
            table, kv_len = self._tables(full, self._window_start(lane), lane.position, steps)
            rows.append(DraftStep(lane.slot, lane.position, lane.token, table, None, full, kv_len))
        self._probs = []
        ids = self.head.chain(rows, steps, self._pick_min_p if self.min_p else self._pick).tolist()
        probs = torch.stack(self._probs, 1).tolist() if self.min_p else None  # [B, steps]
        for j, i in enumerate(active):
            keep = lanes[i].max_drafts
            if probs is not None:  # through the first draft at or below --draft-min-p
                low = next((s for s, p in enumerate(probs[j][:keep]) if p <= self.min_p), None)
                keep = keep if low is None else low + 1
            out[i] = Proposal([int(t) for t in ids[j][:keep]])
        return out

    def _pick_min_p(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax draft, keeping its probability under the full head (--draft-min-p)."""
        p, ids = torch.softmax(self.runner.logits(hidden).float(), dim=-1).max(dim=-1)
        self._probs.append(p)
        return ids

    def _pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft token of each row (device tensor ops only: it runs inside the chain's graph)."""
        if self.proposal is not None:
            return self.proposal.pick(hidden)
        return self.runner.logits(hidden).argmax(dim=-1)

    # -- adaptive width ------------------------------------------------------------------------------
    def round_width(self, lanes, proposals) -> int | None:
        if self.adaptive is None:
            return None
        return self.adaptive.choose([lane.request_id for lane in lanes], len(lanes))

    def observe_round(self, report: RoundReport) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(report)

    def lane_finished(self, request_id: str) -> None:
        if self.adaptive is not None:
            self.adaptive.forget(request_id)

    def request_facts(self, request_id: str) -> dict:
        return self.adaptive.facts(request_id) if self.adaptive is not None else {}
