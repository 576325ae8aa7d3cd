"""The model-family rules (`RULES` in ninfer_core.contract): each a function of a `RunnerContract`
that raises `ContractError` naming the rule. They drive the runner only through the contract
(`ModelRunner.forward`, `commit`, `capture_state`/`restore_state`, `read_pages`/`write_pages`), as
the engine does, on small prompts that cross page boundaries."""

from __future__ import annotations

from pathlib import Path

import torch

from ninfer_core.contract import ContractError, RunnerContract
from ninfer_core.engine.model_api import (
    DECODE,
    LOGITS_ALL,
    LOGITS_LAST,
    PREFILL,
    VERIFY,
    ForwardBatch,
    LaneSegment,
    RunnerOptions,
)

LANES = 6  # state slots the rules use
PAGES_PER_LANE = 8


class Harness:
    """A freshly loaded runner with its cache allocated: lane i owns slot i and its own pages."""

    def __init__(self, contract: RunnerContract, case: str, workdir: Path):
        self.contract, self.case = contract, case
        self.runner = contract.load(workdir)
        self.runner.configure(RunnerOptions(cuda_graph=False, verify_widths=(4,), max_lanes=LANES,
                                            max_segment_tokens=contract.prompt_tokens + 8))
        self.groups = self.runner.cache_spec().group_names
        self.page_size = contract.page_size
        self.runner.allocate_cache(LANES * PAGES_PER_LANE, LANES, self.page_size)
        for slot in range(LANES):
            self.runner.reset_slot(slot)
        self.vocab = int(self.runner.info.vocab_size)

    def pages(self, lane: int) -> list[int]:
        return list(range(lane * PAGES_PER_LANE, (lane + 1) * PAGES_PER_LANE))

    def seg(self, lane: int, start: int, tokens, kind=PREFILL, logits=LOGITS_ALL) -> LaneSegment:
        return LaneSegment(lane, {g: self.pages(lane) for g in self.groups}, start, list(tokens), kind, logits)

    def run(self, *segs: LaneSegment) -> list:
        return [o.logits for o in self.runner.forward(ForwardBatch(list(segs)))]

    def tokens(self, n: int, seed: int) -> list[int]:
        high = min(self.vocab, self.contract.token_high or self.vocab)
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, high, (n,), generator=g).tolist()

    def prefill_all(self, lane: int, tokens) -> torch.Tensor:
        self.runner.reset_slot(lane)
        return self.run(self.seg(lane, 0, tokens))[0]

    def close(self, rule: str, ours, ref, what: str) -> None:
        ours, ref = torch.as_tensor(ours).float(), torch.as_tensor(ref).float()
        if ours.shape != ref.shape:
            raise ContractError(rule, self.case, f"{what}: shape {tuple(ours.shape)} against {tuple(ref.shape)}")
        err = float((ours - ref).abs().max())
        bound = self.contract.atol + self.contract.rtol * float(ref.abs().max())
        if not err <= bound:
            row = int((ours - ref).abs().amax(dim=-1).argmax()) if ours.dim() > 1 else 0
            raise ContractError(rule, self.case, f"{what}: max |difference| {err:.3g} > {bound:.3g} (first at row {row})")


def chunks_of(n: int) -> list[int]:
    """Uneven chunk sizes covering n tokens: 7, 1, 13, then the rest."""
    out, left = [], n
    for size in (7, 1, 13):
        if left <= 0:
            break
        out.append(min(size, left))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return out


def prefill_equals_chunked_prefill(h: Harness) -> None:
    rule = "prefill-equals-chunked-prefill"
    toks = h.tokens(h.contract.prompt_tokens, 1)
    whole = h.prefill_all(0, toks)
    got, at = [], 0
    for size in chunks_of(len(toks)):
        got.append(h.run(h.seg(1, at, toks[at: at + size]))[0].reshape(size, -1))
        at += size
    h.close(rule, torch.cat(got), whole, f"chunks {chunks_of(len(toks))} against one prefill of {len(toks)}")


def decode_equals_prefill(h: Harness) -> None:
    rule = "decode-equals-prefill"
    toks = h.tokens(h.contract.prompt_tokens, 2)
    whole = h.prefill_all(0, toks)
    rows = [h.run(h.seg(1, 0, toks[:1]))[0].reshape(1, -1)]
    for i in range(1, len(toks)):
        rows.append(h.run(h.seg(1, i, toks[i: i + 1], DECODE, LOGITS_LAST))[0].reshape(1, -1))
    h.close(rule, torch.cat(rows), whole, "decode logits at every position against one prefill")


def batch_invariance(h: Harness) -> None:
    rule = "batch-invariance"
    n = h.contract.prompt_tokens
    prompts = [h.tokens(n - 9 * i, 10 + i) for i in range(3)]
    nxt = [h.tokens(2, 20 + i) for i in range(3)]
    alone = []
    for lane, (p, t) in enumerate(zip(prompts, nxt)):
        h.runner.reset_slot(lane)
        first = h.run(h.seg(lane, 0, p, logits=LOGITS_LAST))[0]
        steps = [h.run(h.seg(lane, len(p) + j, [t[j]], DECODE, LOGITS_LAST))[0] for j in range(2)]
        alone.append([first, *steps])
    for lane in range(3, 6):
        h.runner.reset_slot(lane)
    batched = [[x] for x in h.run(*(h.seg(3 + i, 0, p, logits=LOGITS_LAST) for i, p in enumerate(prompts)))]
    for j in range(2):
        outs = h.run(*(h.seg(3 + i, len(p) + j, [nxt[i][j]], DECODE, LOGITS_LAST) for i, p in enumerate(prompts)))
        for i, o in enumerate(outs):
            batched[i].append(o)
    for i in range(3):
        for j, what in enumerate(("prefill", "decode 1", "decode 2")):
            h.close(rule, batched[i][j], alone[i][j], f"lane {i} ({len(prompts[i])} tokens), {what}: "
                                                       "batched with two other lanes against alone")


def capture_restore_equals_recompute(h: Harness) -> None:
    rule = "capture-restore-equals-recompute"
    if not h.runner.supports_context_cache:
        import pytest

        pytest.skip("the runner states no context-cache support (copy_slot/copy_page/capture/restore)")
    toks = h.tokens(h.contract.prompt_tokens, 3)
    extra = h.tokens(3, 4)
    h.prefill_all(0, toks)
    used = -(-len(toks) // h.page_size)
    image = h.runner.capture_state(0)
    data = h.runner.read_pages(h.pages(0)[:used])
    h.runner.reset_slot(4)
    h.runner.restore_state(image, 4)
    h.runner.write_pages(h.pages(4)[:used], data)
    reference = h.prefill_all(2, toks + extra)[len(toks):]
    rows = []
    for j, t in enumerate(extra):
        rows.append(h.run(h.seg(4, len(toks) + j, [t], DECODE, LOGITS_LAST))[0].reshape(1, -1))
    h.close(rule, torch.cat(rows), reference, "decode after restore into slot 4 and its own pages against "
                                              "a prefill of the whole sequence")


def snapshot_equals_prefix(h: Harness) -> None:
    rule = "snapshot-equals-prefix"
    if not h.runner.supports_context_cache:
        import pytest

        pytest.skip("the runner states no context-cache support (copy_slot/copy_page/capture/restore)")
    toks = h.tokens(h.contract.prompt_tokens, 12)
    at = len(toks) - 9  # not on a page boundary
    extra = h.tokens(3, 13)
    h.runner.reset_slot(0)
    h.runner.reset_slot(5)
    seg = h.seg(0, 0, toks, logits=LOGITS_LAST)
    seg.snapshot = (at, 5)
    h.run(seg)
    for src, dst in zip(h.pages(0)[: -(-at // h.page_size)], h.pages(5)):
        h.runner.copy_page(src, dst)
    reference = h.prefill_all(2, toks[:at] + extra)[at:]
    rows = [h.run(h.seg(5, at + j, [t], DECODE, LOGITS_LAST))[0].reshape(1, -1) for j, t in enumerate(extra)]
    h.close(rule, torch.cat(rows), reference, f"decode from the snapshot after {at} of {len(toks)} tokens "
                                              "against a prefill of those tokens")


def verify_commit_rollback(h: Harness) -> None:
    rule = "verify-commit-rollback"
    toks = h.tokens(h.contract.prompt_tokens, 5)
    drafts = h.tokens(4, 6)
    after = h.tokens(2, 7)
    reference = h.prefill_all(1, toks + drafts)[len(toks) - 1:]  # rows predicting each draft and the bonus
    h.prefill_all(0, toks[:-1])
    got = h.run(h.seg(0, len(toks) - 1, [toks[-1], *drafts], VERIFY, LOGITS_ALL))[0]
    h.close(rule, got, reference, "verify logits of k+1 = 5 tokens against a prefill of the same tokens")
    h.runner.commit([(0, 3)])  # keep the last prompt token and two drafts
    kept = toks + drafts[:2]
    again = h.prefill_all(2, kept + after)[len(kept):]
    rows = [h.run(h.seg(0, len(kept) + j, [t], DECODE, LOGITS_LAST))[0].reshape(1, -1) for j, t in enumerate(after)]
    h.close(rule, torch.cat(rows), again, "decode after commit(3) of a verify of 5 against a prefill of the "
                                          "kept tokens")


def uncommitted_verify_refused(h: Harness) -> None:
    rule = "uncommitted-verify-refused"
    toks = h.tokens(h.contract.prompt_tokens, 8)
    h.prefill_all(0, toks)
    h.run(h.seg(0, len(toks), h.tokens(3, 9), VERIFY, LOGITS_ALL))
    try:
        h.run(h.seg(0, len(toks) + 3, h.tokens(1, 10), DECODE, LOGITS_LAST))
    except (RuntimeError, ValueError):
        return
    raise ContractError(rule, h.case, "a decode after a verify without commit ran")


def cpu_reference_path(h: Harness) -> None:
    rule = "cpu-reference-path"
    dev = getattr(h.runner, "device", None)
    if getattr(dev, "type", str(dev)) != "cpu":
        raise ContractError(rule, h.case, f"the contract's load() gave a runner on {dev}, not the CPU")
    if h.runner.launches_async:
        raise ContractError(rule, h.case, "a CPU runner says its forwards only queue device work")
    toks = h.tokens(5, 11)
    out = h.prefill_all(0, toks)
    last = h.run(h.seg(1, 0, toks, logits=LOGITS_LAST))[0]
    if out.dtype != torch.float32 or tuple(out.shape) != (5, h.vocab) or tuple(last.shape) != (h.vocab,):
        raise ContractError(rule, h.case, f"logits {out.dtype} {tuple(out.shape)} / last {tuple(last.shape)}, "
                                          f"expected float32 (5, {h.vocab}) / ({h.vocab},)")
    if not torch.isfinite(out).all():
        raise ContractError(rule, h.case, "logits hold NaN or inf")


RUNNER_RULES = {
    "prefill-equals-chunked-prefill": prefill_equals_chunked_prefill,
    "decode-equals-prefill": decode_equals_prefill,
    "batch-invariance": batch_invariance,
    "capture-restore-equals-recompute": capture_restore_equals_recompute,
    "snapshot-equals-prefix": snapshot_equals_prefix,
    "verify-commit-rollback": verify_commit_rollback,
    "uncommitted-verify-refused": uncommitted_verify_refused,
    "cpu-reference-path": cpu_reference_path,
}
