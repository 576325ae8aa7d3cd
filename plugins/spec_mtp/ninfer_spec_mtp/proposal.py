"""The optimised proposal head: LM-head rows of the most frequent tokens, stored in the artifact by
`ninfer convert --mtp-proposal-head N` (tensors `mtp_proposal.weight` [N, hidden] and
`mtp_proposal.token_ids` [N]). Drafting through it reads N rows instead of the whole vocabulary per
draft step; a draft outside those N tokens is never proposed (verification still decides)."""

from __future__ import annotations

import torch

WEIGHT = "mtp_proposal.weight"
TOKEN_IDS = "mtp_proposal.token_ids"


class ProposalHead:
    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor):
        if weight.dim() != 2 or token_ids.shape != (weight.shape[0],):
            raise ValueError(f"proposal head of shape {tuple(weight.shape)} with {tuple(token_ids.shape)} token ids")
        self.weight = weight
        self.token_ids = token_ids

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    @classmethod
    def from_artifact(cls, artifact, device, dtype=None) -> "ProposalHead | None":
        has = getattr(artifact, "has_tensor", None)
        if artifact is None or not callable(has) or not has(WEIGHT):
            return None
        w = artifact.get_tensor(WEIGHT).to(device=device, dtype=dtype or torch.float32)
        ids = artifact.get_tensor(TOKEN_IDS).to(device=device, dtype=torch.int64)
        return cls(w, ids)

    def pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """The most likely proposal-head token id of each row of `hidden` [B, hidden] (on the device)."""
        scores = torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight)  # [B, N]
        return self.token_ids[scores.argmax(dim=-1)]

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.pick(hidden).tolist()
