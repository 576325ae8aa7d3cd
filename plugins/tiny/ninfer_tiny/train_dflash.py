"""Train ninfer-tiny's DFlash and DFlash2 drafters against the trained target.

    python -m ninfer_tiny.train_dflash --out runs/dflash                    # the CPU recipe (minutes)
    python -m ninfer_tiny.train_dflash --recipe h200 --out runs/dflash-h200  # scripts/dflash/train_tiny_h200.sh
    ... --install    # also write both drafters into the packaged artifact (its dflash and dflash2 components)
    ... --budget 470 # the whole run inside 470 s: data, each drafter's steps and the acceptance table cut to fit

The target is the packaged ninfer-tiny artifact run through ninfer's own forward (the reference
path; CUDA when present), so the features a drafter learns from are the ones serving hands it.
Data: conversations of the tiny plugin's stream (seed 1, the training side of the split) cut into
rows of `seq_len` tokens; per row the target's outputs of the drafter's target layers and its
greedy pick at every position (the labels: a draft is accepted when it equals the target's pick).

A step samples `anchors` block starts per row: a block is [token at a, mask x (block-1)] at
positions a .., attending to the context rows < a and to its own rows (one pass for all blocks of
a row through an explicit key mask); the loss is cross-entropy of block row k against the target's
pick at a + k, weighted exp(-(k-1)/gamma) (later rows matter less: they count only after every
earlier draft was accepted). DFlash2 adds the candidate selector's loss: cross-entropy over each
row's top-k candidates, walked from the true predecessor, where the label is among them.

With `--budget S` every phase has a share of S seconds (data 24%, DFlash 22%, DFlash2 28%, the
acceptance table the rest): the target's rows stop at their share, a drafter's learning-rate schedule
runs on max(step / steps, seconds / share) and stops at 1, and the acceptance table skips what no
longer fits, so one device call of known length trains and reports. Deterministic given --seed on
the CPU without --budget. The drafters are written as published checkpoints
(config.json + model.safetensors in the z-lab layout) and added with `ninfer convert --dflash`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DraftRecipe:
    rows: int
    seq_len: int
    steps: int
    batch: int
    anchors: int
    block: int
    lr: float
    warmup: int
    layers: int
    intermediate: int
    selector_rank: int
    selector_top_k: int
    target_layers: tuple[int, ...] = (3, 7)
    gamma: float = 7.0
    selector_weight: float = 0.5


RECIPES = {
    "cpu": DraftRecipe(rows=192, seq_len=256, steps=400, batch=8, anchors=12, block=16, lr=3e-3, warmup=30,
                       layers=1, intermediate=256, selector_rank=16, selector_top_k=8),
    "h200": DraftRecipe(rows=8192, seq_len=512, steps=6000, batch=32, anchors=24, block=16, lr=2e-3, warmup=200,
                        layers=1, intermediate=256, selector_rank=16, selector_top_k=8),
    "micro": DraftRecipe(rows=8, seq_len=64, steps=4, batch=2, anchors=3, block=8, lr=3e-3, warmup=1,
                         layers=1, intermediate=64, selector_rank=4, selector_top_k=4),
}  # fmt: skip
CONV_GROUP = 16


def log(msg: str) -> None:
    print(msg, flush=True)


def load_target(artifact: str, device: str):
    from ninfer_core.artifact import Artifact
    from ninfer_core.plugins import PluginHost, PluginSelection

    art = Artifact.open(artifact)
    fam = PluginHost(PluginSelection.from_sources([])).family_for_architecture(art.architecture).load()()
    # on CUDA the target runs as it serves (bf16, the GPU runner), so the drafters learn from the
    # features serving hands them; the CPU keeps fp32
    runner = fam.load(art, device=device, dtype="bfloat16" if str(device).startswith("cuda") else "float32")
    return art, runner


BUDGET_SHARES = {"data": 0.24, "dflash": 0.22, "dflash2": 0.28}  # the acceptance table: the rest


def target_rows(runner, tokenizer, recipe: DraftRecipe, seed: int, seconds: float | None = None):
    """Token rows [R, T], the target's layer features [R, T, L*H] and greedy picks [R, T] (fewer
    rows than the recipe's when `seconds` run out first; at least 8)."""
    import torch

    from ninfer_core.engine.model_api import LOGITS_ALL, PREFILL, ForwardBatch, LaneSegment
    from ninfer_tiny.data import make_sample, render_ids

    eot = tokenizer.token_to_id("<|endoftext|>")
    stream: list[int] = []
    i = 0
    while len(stream) < recipe.rows * recipe.seq_len + 1:
        stream += render_ids(make_sample(seed, i), tokenizer) + [eot]
        i += 1
    ids = torch.tensor(stream[: recipe.rows * recipe.seq_len], dtype=torch.int64).view(recipe.rows, recipe.seq_len)
    pages = -(-recipe.seq_len // 64)
    runner.allocate_cache(pages, 1)
    groups = runner.cache_spec().group_names
    feats, picks = [], []
    t0 = time.monotonic()
    for r in range(recipe.rows):
        if seconds is not None and r >= 8 and time.monotonic() - t0 > seconds:
            log(f"[dflash] target features: {r}/{recipe.rows} rows in the {seconds:.0f} s share")
            ids = ids[:r]
            break
        runner.reset_slot(0)
        seg = LaneSegment(0, {g: list(range(pages)) for g in groups}, 0, ids[r].tolist(), PREFILL, LOGITS_ALL,
                          tuple(recipe.target_layers))
        out = runner.forward(ForwardBatch([seg]))[0]
        feats.append(torch.cat([out.hidden[i] for i in recipe.target_layers], -1).to("cpu", torch.bfloat16))
        picks.append(out.logits.argmax(-1).cpu())  # the target's pick for position p + 1
        if (r + 1) % max(1, recipe.rows // 8) == 0:
            log(f"[dflash] target features {r + 1}/{recipe.rows} rows")
    return ids, torch.stack(feats), torch.stack(picks), i


def drafter_config(kind: str, recipe: DraftRecipe, target_cfg: dict, vocab: int, mask_id: int) -> dict:
    from ninfer_spec_dflash.testing import drafter_hf_config

    text = target_cfg.get("text_config", target_cfg)
    return drafter_hf_config(kind, text["hidden_size"], vocab, recipe.target_layers, layers=recipe.layers,
                             heads=4, kv_heads=2, head_dim=64, intermediate=recipe.intermediate,
                             block_size=recipe.block, mask_token_id=mask_id,
                             num_target_layers=text["num_hidden_layers"], selector_rank=recipe.selector_rank,
                             selector_top_k=recipe.selector_top_k, conv_group_size=CONV_GROUP)


def block_batch(ids, picks, recipe: DraftRecipe, g, device):
    """Anchors and the key mask of one batch: (rows idx [B], anchors [B, A], mask [B, A*S, T + A*S])."""
    import torch

    b, a, s, t = recipe.batch, recipe.anchors, recipe.block, recipe.seq_len
    rows = torch.randint(0, ids.shape[0], (b,), generator=g)
    anchors = torch.stack([torch.randperm(t - s - 1, generator=g)[:a] + 1 for _ in range(b)])  # [B, A]
    q_anchor = anchors.repeat_interleave(s, 1)  # [B, A*S]
    ctx = torch.arange(t)[None, None, :] < q_anchor[:, :, None]  # context rows before the anchor
    blk = torch.arange(a).repeat_interleave(s)
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return rows, anchors, torch.cat([ctx, own], -1).to(device)


def train_kind(kind: str, recipe: DraftRecipe, runner, data, cfg_json: dict, seed: int, device,
               seconds: float | None = None):
    """Train one drafter; returns its state dict (checkpoint names) and the loss history. With
    `seconds` the schedule runs on the larger of the step and the time fraction and ends at 1."""
    import torch
    import torch.nn.functional as F
    from ninfer_spec_dflash.config import DrafterConfig
    from ninfer_spec_dflash.model import Drafter

    ids, feats, picks = data
    if str(device).startswith("cuda"):  # the features once on the device (8,192 rows: 4.3 GB in bf16)
        feats = feats.to(device)
    cfg = DrafterConfig.from_hf(cfg_json, kind)
    vocab = runner.info.vocab_size
    torch.manual_seed(seed)
    model = Drafter(cfg, vocab).to(device)
    with torch.no_grad():  # Qwen3-style init: norms at 1, linears small, codebooks small
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            elif "base_kernel" in n or "kernel_projection" in n:
                p.zero_()
            elif "codebook" in n:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.02)
    for p in getattr(runner, "model", torch.nn.Module()).parameters():
        p.requires_grad_(False)  # the target (its embeddings and LM head) stays frozen
    head = lambda h: runner.logits(h.to(runner.dtype))  # the target's LM head, in its dtype
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    s, a = recipe.block, recipe.anchors
    weights = torch.exp(-torch.arange(s - 1, dtype=torch.float32) / recipe.gamma).to(device)
    history = []
    t0 = time.monotonic()
    for step in range(recipe.steps):
        frac = step / recipe.steps
        if seconds is not None:
            frac = max(frac, (time.monotonic() - t0) / seconds)
            if frac >= 1.0:
                log(f"[dflash] {kind}: {step} of {recipe.steps} steps in the {seconds:.0f} s share")
                break
        lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        rows, anchors, mask = block_batch(ids, picks, recipe, g, device)
        b = rows.shape[0]
        x_ids = torch.full((b, a, s), cfg.mask_token_id, dtype=torch.int64)
        x_ids[:, :, 0] = ids[rows].gather(1, anchors)
        pos = (anchors[:, :, None] + torch.arange(s)).view(b, -1).to(device)
        # labels: the target's pick at a + k (picks[p] is the pick for position p + 1)
        lab_pos = anchors[:, :, None] + torch.arange(s)[None, None, :-1]  # [B, A, S-1] = a + k - 1
        labels = picks[rows][torch.arange(b)[:, None, None], lab_pos].to(device)
        ctx = model.context(feats[rows].to(device, torch.float32))  # [B, T, H]
        ctx_kv = model.context_kv(ctx, torch.arange(recipe.seq_len, device=device).expand(b, -1))
        with torch.no_grad():
            x = runner.embed(x_ids.to(device).view(-1)).view(b, a * s, -1).float()
        kpos = torch.cat([torch.arange(recipe.seq_len, device=device).expand(b, -1), pos], 1)
        hidden = model(x, pos, ctx_kv, mask, kpos, block=s).view(b, a, s, -1)[:, :, 1:]  # [B, A, S-1, H]
        logits = head(hidden.reshape(-1, hidden.shape[-1])).view(b, a, s - 1, -1)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        w = weights.expand(b, a, -1).reshape(-1)
        loss = (ce * w).sum() / w.sum()
        sel_loss = torch.zeros((), device=device)
        if kind == "dflash2":
            sel = model.candidate_selector
            unary, cand = torch.topk(logits.float(), sel.top_k, dim=-1)  # [B, A, S-1, k]
            prev = torch.cat([x_ids[:, :, :1].to(device), labels[:, :, :-1]], -1)  # true predecessors
            scores = sel.scores(prev, sel.hidden_projection(hidden), cand, unary)
            hit = cand == labels[..., None]
            ok = hit.any(-1)
            if bool(ok.any()):
                sel_ce = F.cross_entropy(scores[ok], hit[ok].float().argmax(-1), reduction="none")
                wk = weights.expand(b, a, -1)[ok]
                sel_loss = (sel_ce * wk).sum() / wk.sum()
        total = loss + recipe.selector_weight * sel_loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % max(1, recipe.steps // 20) == 0 or step == recipe.steps - 1:
            acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            rec = {"step": step, "loss": loss.item(), "selector": sel_loss.item(),
                   "first_acc": acc[0].item(), "mean_acc": acc.mean().item()}
            history.append(rec)
            log(f"[dflash] {kind} step {step:5d}/{recipe.steps}  loss {rec['loss']:.3f}  sel {rec['selector']:.3f}  "
                f"acc@1 {rec['first_acc']:.3f}  acc {rec['mean_acc']:.3f}  {time.monotonic() - t0:.0f}s")
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, history


def acceptance(artifact: str, kinds, ks, prompts: int, seed: int, max_tokens: int = 96,
               deadline: float | None = None, device: str = "cpu") -> dict:
    """{K: {backend: ...}}: accepted tokens per round (committed per round = accepted + 1) of greedy
    requests through the engine with each backend at each K, on held-out prompts, beside plain
    decoding (run once; outputs must equal it). A run that would start past `deadline` (a
    time.monotonic() value) is left out and listed under "skipped". The engine runs on `device`
    (the serving path there: bf16 and CUDA Graphs on CUDA)."""
    import argparse as ap

    from ninfer_core.artifact import Artifact
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.testing import collect, run_async
    from ninfer_core.tokenizer.bpe import Tokenizer
    from ninfer_tiny.data import eval_prompts, project_template

    art = Artifact.open(artifact)
    host = PluginHost(PluginSelection.from_sources([]))
    fam = host.family_for_architecture(art.architecture).load()()
    tok = Tokenizer(art.tokenizer_section)
    samples = eval_prompts(seed, -(-prompts // 3))[:prompts]
    tmpl = project_template()
    reqs = [tmpl.render_ids(tok, s.prompt_messages(), tools=s.tools, add_generation_prompt=True) for s in samples]

    def run(name, k=None):
        runner = fam.load(art, device=device)
        backend = None
        if name:
            backend = host.resolve_spec_backend(name).load().load(runner, art, ap.Namespace(draft_tokens=k))

        async def go():
            eng = Engine(runner, tok, EngineOptions(max_context=2048, prefill_chunk=256, ngram_draft_tokens=0,
                                                    device=device), spec=backend)
            eng.start()
            try:
                outs = [await collect(eng.submit(GenerationRequest(prompt_ids=p, max_tokens=max_tokens,
                                                                   sampling=SamplingParams(temperature=0.0))))
                        for p in reqs]
                return outs, eng.snapshot()["counters"]
            finally:
                eng.shutdown(timeout=60)

        t0 = time.monotonic()
        outs, c = run_async(go(), timeout=1800)
        return [o.token_ids for o in outs], c, time.monotonic() - t0

    plain, pc, ps = run(None)
    base = {"seconds": ps, "decode_tok_s": pc["committed_decode_tokens"] / max(pc["decode_seconds"], 1e-9)}
    table = {}
    for k in ks:
        table[k] = {"plain": base, "skipped": []}
        for name in kinds:
            if deadline is not None and time.monotonic() > deadline:
                table[k]["skipped"].append(name)
                log(f"[dflash] {name} K={k}: skipped (the budget's acceptance share is spent)")
                continue
            try:
                table[k][name] = _acceptance_row(name, k, run, plain, base)
            # one backend failing leaves the others' rows (and the checkpoints already written)
            except Exception as e:  # noqa: BLE001
                log(f"[dflash] {name} K={k}: failed: {type(e).__name__}: {e}")
                table[k]["skipped"].append(f"{name} (failed: {type(e).__name__})")
    return table


def _acceptance_row(name, k, run, plain, base) -> dict:
    """One backend's row of the acceptance table (its run through `run`, compared with `plain`)."""
    got, c, _ = run(name, k)
    rounds = max(c["draft_rounds"], 1)
    row = {"k": k, "rounds": c["draft_rounds"], "drafted": c["draft_tokens"],
           "accepted": c["draft_accepted_tokens"],
           "accepted_per_round": c["draft_accepted_tokens"] / rounds,
           "acceptance_length": 1 + c["draft_accepted_tokens"] / rounds,
           "decode_tok_s": c["committed_decode_tokens"] / max(c["decode_seconds"], 1e-9),
           "same_as_plain": sum(a == b for a, b in zip(got, plain)), "requests": len(plain)}
    log(f"[dflash] {name} K={k}: {row['acceptance_length']:.2f} tokens per round "
        f"({row['accepted']}/{row['drafted']} drafts accepted), {row['decode_tok_s']:.1f} "
        f"tok/s vs plain {base['decode_tok_s']:.1f}, {row['same_as_plain']}/{len(plain)} equal")
    return row


def train(out: Path, recipe: DraftRecipe, artifact: str, seed: int = 0, device: str | None = None,
          eval_prompts: int = 12, budget: float | None = None, merged_dir: Path | None = None) -> dict:
    """Collect the target's rows, train both drafters, write them as checkpoints under `out` and
    merged into a copy of the artifact (under `merged_dir`, default `out`), then the acceptance
    table. `budget`: seconds for the whole run (BUDGET_SHARES)."""
    import torch
    from ninfer_spec_dflash.testing import write_drafter_checkpoint

    from ninfer_core.cli import main as cli
    from ninfer_core.tokenizer.bpe import Tokenizer

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    art, runner = load_target(artifact, dev)
    tok = Tokenizer(art.tokenizer_section)
    # the mask token: an id past the tokenizer's (padding rows of the embedding the target never saw)
    mask_id = runner.info.vocab_size - 1
    if mask_id < tok.vocab_size:
        raise ValueError("the target has no unused vocabulary row for the mask token")
    log(f"[dflash] target {artifact}: {runner.info.n_params / 1e6:.1f} M parameters, device {dev}")
    share = (lambda part: None) if budget is None else (lambda part: budget * BUDGET_SHARES[part])
    ids, feats, picks, convs = target_rows(runner, tok, recipe, seed + 1, share("data"))
    log(f"[dflash] data: {ids.numel():,} tokens from {convs} conversations ({time.monotonic() - t0:.0f}s)")
    summary = {"recipe": asdict(recipe), "seed": seed, "device": dev, "artifact": artifact, "kinds": {}}
    dirs = {}
    for kind in ("dflash", "dflash2"):
        cfg = drafter_config(kind, recipe, art.config, runner.info.vocab_size, mask_id)
        state, hist = train_kind(kind, recipe, runner, (ids, feats, picks), cfg, seed, dev, share(kind))
        dirs[kind] = write_drafter_checkpoint(out / kind, cfg, state, dtype=torch.bfloat16)
        n = sum(v.numel() for v in state.values())
        summary["kinds"][kind] = {"params": n, "history": hist, "checkpoint": dirs[kind]}
        log(f"[dflash] {kind}: {n / 1e6:.2f} M parameters -> {dirs[kind]}")
    (merged_dir or out).mkdir(parents=True, exist_ok=True)
    merged = (merged_dir or out) / "ninfer-tiny.ninfer"
    if cli(["convert", artifact, str(merged), "--dflash", dirs["dflash"], "--dflash2", dirs["dflash2"],
            "--no-progress"]) != 0:
        raise RuntimeError("ninfer convert of the drafters failed")
    summary["merged"] = str(merged)
    if eval_prompts:
        ks = sorted({min(7, recipe.block - 1), min(15, recipe.block - 1)})
        # the table's last run may start until 40 s before the budget's end (a run takes ~15-30 s there)
        deadline = None if budget is None else t0 + budget - 40
        summary["acceptance"] = acceptance(str(merged), ["mtp", "dflash", "dflash2"], ks, eval_prompts, seed,
                                           deadline=deadline, device=dev)
        log(acceptance_table(summary["acceptance"]))
    summary["seconds"] = time.monotonic() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    log(f"[dflash] done in {summary['seconds']:.0f}s")
    return summary


def acceptance_table(table: dict) -> str:
    """The acceptance table as text: tokens committed per round (accepted drafts + 1) and tok/s."""
    lines = ["[dflash] acceptance (tokens committed per round = accepted drafts + 1; greedy, held-out prompts)",
             f"  {'backend':8} {'K':>3} {'tok/rnd':>8} {'accepted':>12} {'tok/s':>9} {'vs plain':>9} {'same':>6}"]
    for k, rows in table.items():
        plain = rows["plain"]["decode_tok_s"]
        lines.append(f"  {'plain':8} {'-':>3} {'1.00':>8} {'':>12} {plain:9.1f} {'1.00':>9} {'':>6}")
        for name, r in rows.items():
            if name in ("plain", "skipped"):
                continue
            lines.append(f"  {name:8} {k:>3} {r['acceptance_length']:8.2f} {r['accepted']:>5}/{r['drafted']:<6} "
                         f"{r['decode_tok_s']:9.1f} {r['decode_tok_s'] / max(plain, 1e-9):9.2f} "
                         f"{r['same_as_plain']:>3}/{r['requests']:<2}")
        if rows.get("skipped"):
            lines.append(f"  K={k} skipped: {', '.join(rows['skipped'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ninfer_tiny.train import package_artifact_path

    p = argparse.ArgumentParser(prog="python -m ninfer_tiny.train_dflash", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoints, merged artifact, summary)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="cpu")
    p.add_argument("--artifact", default=None, help="the target artifact (default: the packaged ninfer-tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts of the acceptance table (0: none)")
    p.add_argument("--install", action="store_true", help="replace the packaged artifact with the merged one")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="the whole run inside this many seconds (data, training and the table cut to fit)")
    p.add_argument("--merged-dir", type=Path, default=None,
                   help="where the merged artifact goes (default: --out; keep it out of a folder that travels back)")
    a = p.parse_args(argv)
    artifact = a.artifact or str(package_artifact_path())
    summary = train(a.out, RECIPES[a.recipe], artifact, a.seed, a.device, a.eval_prompts, a.budget, a.merged_dir)
    if a.install:
        dest = package_artifact_path()
        tmp = str(dest) + ".part"
        shutil.copyfile(summary["merged"], tmp)
        os.replace(tmp, dest)
        log(f"[dflash] installed {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
