"""Speculative decoding across pipeline stages: the draft head on the last stage, the LM head there.

A family's draft head (MTP) conditions on the target's final hidden state and drafts through the
LM head, both on the last stage, so it is enabled there: every target forward's ride-along writes
its K/V on that stage, its pages and the lane's last hidden are that stage's cache (checkpoints
carry them like any other stage's). The engine's backend talks to `StageDraftHead`, which runs
each draft step on the last stage; `logits` of a drafter on rank 0 (DFlash, which reads stage 0's
embeddings and every stage's asked layer outputs) runs the LM head there. Both travel over the
stage's pipe as host tensors: a draft step is [lanes, hidden], small beside a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ninfer_core.engine.model_api import DraftHead, DraftStep


def host(t):
    return None if t is None else t.detach().to("cpu")


class StageDraftHead(DraftHead):
    """The last stage's draft head as the engine's process reaches it (`DraftHead.chain` runs its
    steps one by one, the pick on rank 0)."""

    def __init__(self, runner, name: str, kv_group: str, hidden_size: int):
        self.runner, self.name, self.kv_group, self.hidden_size = runner, name, kv_group, hidden_size

    def step(self, rows: Sequence[DraftStep]) -> Any:
        rows = [replace(r, table=list(r.table), write_table=None if r.write_table is None else list(r.write_table),
                        prev_hidden=host(r.prev_hidden)) for r in rows]
        return self.runner.on_last("draft_step", self.name, rows).to(self.runner.device)


def worker_op(runner, heads: dict, op: str, args: tuple):
    """A draft / LM head op on a worker stage (the last): the answer as host tensors."""
    if op == "draft_heads":
        return tuple(runner.draft_heads())
    if op == "enable_draft_head":
        (name,) = args
        head = runner.enable_draft_head(name)
        heads[name] = head
        return head.name, head.kv_group, int(head.hidden_size)
    if op == "draft_step":
        name, rows = args
        head = heads.get(name)
        if head is None:
            raise ValueError(f"draft head {name!r} is not enabled on this stage")
        dev = runner.device
        rows = [replace(r, prev_hidden=None if r.prev_hidden is None else r.prev_hidden.to(dev)) for r in rows]
        return host(head.step(rows))
    if op == "logits":
        (hidden,) = args
        return host(runner.logits(hidden.to(runner.device)))
    raise ValueError(f"unknown pipeline op {op!r}")


WORKER_OPS = frozenset({"draft_heads", "enable_draft_head", "draft_step", "logits"})
