"""Train ninfer-tiny: tokenizer, data, model, checkpoints, the artifact.

    python -m ninfer_tiny.train --out runs/tiny            # the full recipe (one H200, ~10 min)
    python -m ninfer_tiny.train --recipe micro --out /tmp/m  # seconds on a CPU (tests)
    ... --install    # also copy the artifact into the ninfer_tiny package (the shipped default)

Deterministic given --seed: the data (sample i of seed s), the tokenizer (trained on a fixed
subset), the initial weights (torch.manual_seed), and the batch order (a seeded permutation). On
CUDA, bf16 autocast and deterministic algorithms; on the CPU, fp32.

Full recipe sizing (why these numbers): 10.0 M parameters (hidden 256, 8 layers = 6 GDN + 2
attention, tied 8448-entry embedding, one MTP layer), so the bf16 artifact is ~20 MB (< 25 MB).
A step is 64 rows x 1024 tokens = 65,536 tokens; 3,000 steps = 197 M tokens, about 2.5 epochs of
the ~80 M-token corpus (300k conversations at ~262 tokens each, plus 8 copies of the 0.19 M
tokens of prose). Training FLOPs ~ 6 N D = 6 x 10.0e6 x
1.97e8 = 1.2e16 (+ ~10% attention and MTP): 1.3e16 FLOPs, i.e. ~130 s at 100 TFLOP/s and ~430 s
at 30 TFLOP/s (the torch GDN path of transformers is launch-bound at this width, so we plan for
the low end). `--fit-minutes 13` times steps 6-25 (the first 5 carry one-off set-up costs) and
shortens the schedule to fit if the machine is slower than planned (the chosen length is printed;
`--schedule-steps N` reproduces it); `--max-minutes` is a hard stop with a final checkpoint and artifact.
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
from multiprocessing import Pool
from pathlib import Path

NAME = "ninfer-tiny"
FIT_SKIP = 5  # first steps --fit-minutes does not time (allocator, cuBLAS/cuDNN set-up, autotuning)
FIT_PROBE = 20  # steps timed by --fit-minutes after those (all inside the full recipe's 150-step warm-up)
FIT_RESERVE_S = 60  # what --fit-minutes keeps for the artifact, checkpoints and slack


@dataclass(frozen=True)
class Recipe:
    bpe_vocab: int
    bpe_train_samples: int
    samples: int
    prose_docs: int  # 0 = all training documents
    prose_repeat: int  # copies of the prose in the stream (it is small next to the conversations)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_key_heads: int
    lin_value_heads: int
    lin_head_dim: int
    intermediate: int
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    log_every: int
    ckpt_every: int


RECIPES = {
    "full": Recipe(bpe_vocab=8192, bpe_train_samples=40_000, samples=300_000, prose_docs=0, prose_repeat=8, hidden=256,
                   layers=8, heads=4, kv_heads=2, head_dim=64, lin_key_heads=4, lin_value_heads=8,
                   lin_head_dim=32, intermediate=768, seq_len=1024, batch=64, steps=3000, lr=3e-3,
                   warmup=150, log_every=25, ckpt_every=500),
    "micro": Recipe(bpe_vocab=400, bpe_train_samples=300, samples=300, prose_docs=4, prose_repeat=1, hidden=32, layers=4,
                    heads=2, kv_heads=1, head_dim=16, lin_key_heads=1, lin_value_heads=2, lin_head_dim=16,
                    intermediate=64, seq_len=128, batch=4, steps=12, lr=1e-2, warmup=2, log_every=4,
                    ckpt_every=6),
}  # fmt: skip


def log(msg: str) -> None:
    print(msg, flush=True)


# data --------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(section: dict) -> None:
    from ninfer_core.tokenizer.bpe import Tokenizer

    _WORKER["tok"] = Tokenizer(section)


def _encode_samples(args: tuple[int, int, int]) -> list[int]:
    from ninfer_tiny.data import make_sample, render_ids

    seed, lo, hi = args
    tok = _WORKER["tok"]
    eot = tok.token_to_id("<|endoftext|>")
    out: list[int] = []
    for i in range(lo, hi):
        out += render_ids(make_sample(seed, i), tok) + [eot]
    return out


def train_tokenizer(recipe: Recipe, seed: int) -> dict:
    from ninfer_tiny import prose
    from ninfer_tiny.bpe import train_section
    from ninfer_tiny.data import make_sample, render

    docs, _ = prose.split()
    docs = docs[: recipe.prose_docs or None]
    texts = [render(make_sample(seed, i)) for i in range(recipe.bpe_train_samples)] + docs
    return train_section(texts, vocab_size=recipe.bpe_vocab)


def build_tokens(recipe: Recipe, section: dict, seed: int, workers: int):
    """The training token stream (int32): conversations then prose, each ending in <|endoftext|>."""
    import torch

    from ninfer_core.tokenizer.bpe import Tokenizer
    from ninfer_tiny import prose

    chunk = max(1, min(2000, recipe.samples // max(workers, 1) or 1))
    jobs = [(seed, lo, min(lo + chunk, recipe.samples)) for lo in range(0, recipe.samples, chunk)]
    if workers > 1:
        with Pool(workers, initializer=_init_worker, initargs=(section,)) as pool:
            parts = pool.map(_encode_samples, jobs)
    else:
        _init_worker(section)
        parts = [_encode_samples(j) for j in jobs]
    tok = Tokenizer(section)
    eot = tok.token_to_id("<|endoftext|>")
    docs, _ = prose.split()
    docs = docs[: recipe.prose_docs or None]
    prose_ids = [t for d in docs for t in tok.encode(d, allow_special=False) + [eot]]
    parts += [prose_ids] * recipe.prose_repeat
    return torch.cat([torch.tensor(p, dtype=torch.int32) for p in parts if p])


def batches(tokens, recipe: Recipe, seed: int):
    """Rows of seq_len + 1 tokens cut from the stream, in a seeded permutation, epoch after epoch."""
    import torch

    n_rows = (len(tokens) - 1) // recipe.seq_len
    if n_rows < recipe.batch:
        raise ValueError(f"corpus of {len(tokens)} tokens is too small for batch {recipe.batch}")
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n_rows, generator=g)
        for i in range(0, n_rows - recipe.batch + 1, recipe.batch):
            starts = perm[i : i + recipe.batch] * recipe.seq_len
            idx = starts[:, None] + torch.arange(recipe.seq_len + 1)[None, :]
            yield tokens[idx].long()


# artifact ----------------------------------------------------------------------------------------


def write_tiny_artifact(path, model, section: dict) -> str:
    """Write the trained model as a `.ninfer` artifact (bf16, checkpoint names, flat text layout)."""
    import torch
    from ninfer_qwen35.chat import QWEN35_TEMPLATE

    from ninfer_core.artifact import TensorSpec, write_artifact

    state = model.checkpoint_state()
    specs = [
        TensorSpec(name, torch.bfloat16, tuple(t.shape), (lambda t=t: t.detach().float().cpu().to(torch.bfloat16)))
        for name, t in sorted(state.items())
    ]
    cfg = dict(model.cfg, architectures=["Qwen3_5ForCausalLM"])
    manifest = {
        "name": NAME, "architecture": cfg["model_type"], "config": cfg, "tokenizer": section,
        "chat_template": QWEN35_TEMPLATE, "identity": {"model_id": NAME}, "generation": {},
    }  # fmt: skip
    path = os.fspath(path)
    tmp = path + ".part"
    write_artifact(tmp, manifest, specs)
    os.replace(tmp, path)
    return path


def package_artifact_path() -> Path:
    return Path(__file__).resolve().parent / "data" / f"{NAME}.ninfer"


# training ----------------------------------------------------------------------------------------


class StepProbe:
    """Times FIT_PROBE steps after the first FIT_SKIP of a run (for --fit-minutes).

    The first steps of a run pay one-off costs (CUDA context and allocator growth, cuBLAS/cuDNN
    handles and autotuning): timing them made the H200 probe read 0.50 s/step for a run that then
    went at ~0.28 s/step. `sync` (torch.cuda.synchronize on CUDA) runs before each clock reading so
    queued kernels are counted in the right window. `done(k)` is called after the k-th step of this
    run (1-based); it answers the seconds per step once, at k = FIT_SKIP + FIT_PROBE, else None.
    """

    def __init__(self, clock=time.monotonic, sync=None, skip: int = FIT_SKIP, probe: int = FIT_PROBE):
        self.clock, self.sync, self.skip, self.probe = clock, sync or (lambda: None), skip, probe
        self.t_start: float | None = None

    @property
    def end(self) -> int:
        return self.skip + self.probe

    def done(self, k: int) -> float | None:
        if k == self.skip:
            self.sync()
            self.t_start = self.clock()
        if k == self.end and self.t_start is not None:
            self.sync()
            return (self.clock() - self.t_start) / self.probe
        return None


def fitted_steps(done: int, per_step: float, seconds_left: float, schedule: int) -> int:
    """The schedule length that ends within `seconds_left` from step `done` (never below `done`)."""
    return max(done, min(schedule, done + int(max(seconds_left, 0.0) / per_step)))


def attention_backend(dev_type: str, choice: str = "math"):
    """The SDPA context for a training step.

    On CUDA, "math" restricts scaled_dot_product_attention to its math backend: plain matmuls and a
    softmax, so forward and backward are bit-for-bit repeatable under deterministic algorithms,
    where the cuDNN (and memory-efficient) attention backward is not. At this width (3 attention
    layers of 8 + MTP, 1,024 tokens) it costs little next to the Gated DeltaNet scan. "auto" leaves
    PyTorch's choice (what trained the shipped artifact). On the CPU nothing changes.
    """
    import contextlib

    if dev_type != "cuda" or choice == "auto":
        return contextlib.nullcontext()
    if choice != "math":
        raise ValueError(f"unknown attention backend {choice!r} (math or auto)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def lr_at(step: int, recipe: Recipe, total: int | None = None) -> float:
    """Linear warm-up, then cosine to 10% at `total` steps (the recipe's by default)."""
    total = total or recipe.steps
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = (step - recipe.warmup) / max(1, total - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(out: Path, recipe: Recipe, seed: int = 0, workers: int = 1, device: str | None = None,
          max_minutes: float | None = None, steps: int | None = None, resume: bool = False,
          schedule_steps: int | None = None, fit_minutes: float | None = None,
          attention: str = "math") -> dict:
    """Run the whole recipe into `out`; returns the summary (also written to out/summary.json).

    steps: stop after this many (default: the schedule's length). schedule_steps: the learning-rate
    schedule's length (default: the recipe's). fit_minutes: time FIT_PROBE steps after the first
    FIT_SKIP (all still in warm-up, so identical whatever the schedule) and shorten the schedule
    and the run so the whole command ends within that many minutes; the summary records the
    chosen count, and `--schedule-steps N` reproduces the same weights without the probe.
    attention: the SDPA backend on CUDA (`attention_backend`): "math" (repeatable) or "auto".

    resume: continue from out/checkpoint.pt (model, optimizer, step; the batch stream is replayed
    to the same point, so a resumed run ends with the same weights as an uninterrupted one).
    """
    import torch

    from ninfer_tiny.model import TinyQwen, count_parameters, text_config

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
    schedule = schedule_steps or recipe.steps
    steps = steps or schedule

    log(f"[tiny] tokenizer: training a {recipe.bpe_vocab}-id byte-level BPE")
    section = train_tokenizer(recipe, seed)
    (out / "tokenizer_section.json").write_text(json.dumps(section), encoding="utf-8")
    n_added = len(section["added_tokens"])
    vocab = -(-(recipe.bpe_vocab + n_added) // 256) * 256
    eos = next(t["id"] for t in section["added_tokens"] if t["content"] == "<|im_end|>")

    log(f"[tiny] data: rendering {recipe.samples} conversations with {workers} workers")
    tokens = build_tokens(recipe, section, seed, workers)
    log(f"[tiny] data: {len(tokens):,} tokens ({time.monotonic() - t0:.0f}s so far)")

    cfg = text_config(
        vocab, hidden=recipe.hidden, layers=recipe.layers, heads=recipe.heads, kv_heads=recipe.kv_heads,
        head_dim=recipe.head_dim, lin_key_heads=recipe.lin_key_heads, lin_value_heads=recipe.lin_value_heads,
        lin_head_dim=recipe.lin_head_dim, intermediate=recipe.intermediate, eos_token_id=eos,
    )  # fmt: skip
    model = TinyQwen(cfg, seed=seed).to(dev)
    n_params = count_parameters(model)
    log(f"[tiny] model: {n_params / 1e6:.2f} M parameters, vocab {vocab}, device {dev}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    data = batches(tokens, recipe, seed)
    start = 0
    if resume and (out / "checkpoint.pt").is_file():
        ckpt = torch.load(out / "checkpoint.pt", map_location=dev, weights_only=False)
        model.load_state_dict(ckpt["model"])
        if "opt" in ckpt:
            opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
        for _ in range(start):
            next(data)
        log(f"[tiny] resumed at step {start}")
    history: list[dict] = []
    t_train, seen, done = time.monotonic(), 0, start
    probe = StepProbe(sync=torch.cuda.synchronize if dev.type == "cuda" else None)
    stopped_early = False
    for step in range(start, steps):
        if step >= steps:  # --fit-minutes shortened the run
            break
        if max_minutes is not None and time.monotonic() - t0 > max_minutes * 60:
            stopped_early = True
            log(f"[tiny] time budget of {max_minutes} min reached at step {step}: stopping")
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe, schedule)
        ids = next(data).to(dev, non_blocking=True)
        with attention_backend(dev.type, attention):
            with amp:
                loss, main, mtp = model(ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += ids.numel()
        done = step + 1
        per_step = probe.done(step + 1 - start) if fit_minutes is not None else None
        if per_step is not None:
            left = fit_minutes * 60 - (time.monotonic() - t0) - FIT_RESERVE_S
            fitted = fitted_steps(step + 1, per_step, left, schedule)
            if fitted < schedule:
                schedule = steps = fitted
            log(f"[tiny] {per_step:.3f} s/step (steps {start + FIT_SKIP + 1}-{step + 1}): "
                f"running {steps} steps (schedule {schedule}); --schedule-steps {schedule} reproduces this run")
        if step % recipe.log_every == 0 or step in (start, steps - 1):
            rate = seen / max(time.monotonic() - t_train, 1e-9)
            rec = {"step": step, "loss": loss.item(), "main": main.item(), "mtp": mtp.item(), "tok_s": rate}
            history.append(rec)
            log(f"[tiny] step {step:5d}/{steps}  loss {rec['loss']:.4f}  main {rec['main']:.4f}  "
                f"mtp {rec['mtp']:.4f}  lr {lr_at(step, recipe, schedule):.2e}  {rate:,.0f} tok/s")
        if (step + 1) % recipe.ckpt_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1, "cfg": cfg},
                       out / "checkpoint.pt")
    final_step = done
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": final_step, "cfg": cfg},
               out / "checkpoint.pt")
    artifact = write_tiny_artifact(out / f"{NAME}.ninfer", model, section)
    summary = {
        "recipe": asdict(recipe), "seed": seed, "device": str(dev), "params": n_params, "vocab": vocab,
        "tokens": len(tokens), "steps": final_step, "schedule_steps": schedule, "stopped_early": stopped_early,
        "attention": attention if dev.type == "cuda" else None,
        "history": history,
        "artifact": artifact, "artifact_bytes": os.path.getsize(artifact), "seconds": time.monotonic() - t0,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    log(f"[tiny] wrote {artifact} ({summary['artifact_bytes'] / 1e6:.1f} MB) in {summary['seconds']:.0f}s")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninfer_tiny.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, artifact, summary)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (the learning-rate schedule stays the recipe's)")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="data rendering processes")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop early past this wall time")
    p.add_argument("--schedule-steps", type=int, default=None, help="learning-rate schedule length")
    p.add_argument("--fit-minutes", type=float, default=None,
                   help="shorten the schedule, after timing the first steps, to end within this time")
    p.add_argument("--attention", choices=["math", "auto"], default="math",
                   help="SDPA backend on CUDA: math (bit-for-bit repeatable, the default) or auto "
                        "(PyTorch's choice, cuDNN on Hopper: its backward is not repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--install", action="store_true", help="copy the artifact into the ninfer_tiny package")
    a = p.parse_args(argv)
    summary = train(a.out, RECIPES[a.recipe], a.seed, a.workers, a.device, a.max_minutes, a.steps, a.resume,
                    a.schedule_steps, a.fit_minutes, a.attention)
    if a.install:
        dest = package_artifact_path()
        shutil.copyfile(summary["artifact"], dest)
        log(f"[tiny] installed {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
