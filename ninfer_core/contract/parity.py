"""Logit parity of a model family's runner with a transformers model over the same weights (the
project's correctness oracle, ARCHITECTURE.md): the same tokens through one prefill, chunked
prefill and token-by-token decode, each against one full forward of the transformers model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.engine.model_api import (
    DECODE,
    LOGITS_ALL,
    LOGITS_LAST,
    ForwardBatch,
    LaneSegment,
    RunnerOptions,
)


class ParityError(AssertionError):
    """Ours and transformers differ beyond the tolerance on one path; str() names the path."""


@torch.no_grad()
def transformers_logits(hf_model, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of one full forward of a transformers causal LM, no KV cache."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return hf_model(input_ids=ids, use_cache=False).logits[0].float()


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max|ref|."""
    ours, ref = torch.as_tensor(ours).float(), torch.as_tensor(ref).float()
    return float((ours - ref).abs().max() / ref.abs().max())


def transformers_parity(runner, hf_model, tokens: Sequence[int], *, chunk: int = 7, rtol: float = 1e-4,
                        page_size: int = 16, label: str = "") -> dict[str, float]:
    """Check `runner` (a fresh one: its cache is allocated here) against `hf_model` on `tokens`:
    one prefill, prefill in chunks of `chunk`, and token-by-token decode, each compared at every
    position to transformers' logits as max|ours - hf| / max|hf| <= rtol. Returns {path: error};
    raises ParityError naming the first path over the tolerance."""
    tokens = [int(t) for t in tokens]
    ref = transformers_logits(hf_model, tokens)
    pages = -(-len(tokens) // page_size)
    runner.configure(RunnerOptions(cuda_graph=False, max_lanes=3, max_segment_tokens=len(tokens)))
    runner.allocate_cache(3 * pages, 3, page_size)
    groups = runner.cache_spec().group_names

    def run(slot, start, toks, kind="prefill", logits=LOGITS_ALL):
        table = list(range(slot * pages, (slot + 1) * pages))
        seg = LaneSegment(slot, {g: table for g in groups}, start, list(toks), kind, logits)
        return runner.forward(ForwardBatch([seg]))[0].logits.reshape(len(toks), -1)

    for slot in range(3):
        runner.reset_slot(slot)
    paths = {"one prefill": run(0, 0, tokens)}
    paths[f"prefill in chunks of {chunk}"] = torch.cat(
        [run(1, i, tokens[i: i + chunk]) for i in range(0, len(tokens), chunk)])
    rows = [run(2, 0, tokens[:1])]
    rows += [run(2, i, tokens[i: i + 1], DECODE, LOGITS_LAST) for i in range(1, len(tokens))]
    paths["token-by-token decode"] = torch.cat(rows)
    errors = {}
    for path, ours in paths.items():
        if ours.shape != ref.shape:
            raise ParityError(f"{label} {path}: logits {tuple(ours.shape)} against transformers' {tuple(ref.shape)}")
        errors[path] = rel_err(ours, ref)
        if not errors[path] <= rtol:
            raise ParityError(f"{label} {path}: max|ours - transformers| / max|transformers| = "
                              f"{errors[path]:.3e} > {rtol:g} over {len(tokens)} tokens")
    return errors
