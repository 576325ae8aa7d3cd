"""Count the device launches of a forward: Triton kernel launches plus the torch ops that run a
kernel (views, reshapes and allocations run none). CPU-runnable: with TRITON_INTERPRET=1 the
Triton kernels are counted as they are interpreted, so the count of a decode step on the CPU is
the count the GPU would launch for the same code path (cuBLAS GEMMs count one each; cuBLAS may
add a split-K reduction kernel on the device). On CUDA, `cuda_kernels` counts the kernels the
profiler sees, the exact figure.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing (metadata, allocation without a fill)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "lift_fresh", "detach", "detach_", "alias", "_to_copy_noop",
              "set_", "resize_", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride", "sym_numel"}


class _Counter(TorchDispatchMode):
    def __init__(self, tally):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.tally["inside"]:
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _NO_KERNEL:
                key = f"torch.{name}"
                self.tally["ops"][key] = self.tally["ops"].get(key, 0) + 1
        return out


@contextlib.contextmanager
def counting():
    """Yields a tally {"ops": {name: launches}}; Triton launches are keyed "triton.<kernel>"."""
    tally = {"ops": {}, "inside": 0}
    patched = []
    try:
        import triton.runtime.jit as J

        classes = [J.JITFunction]
        try:
            import triton.runtime.interpreter as I

            classes.append(I.InterpretedFunction)
        except ImportError:  # pragma: no cover - depends on the triton release
            pass
        for cls in classes:
            orig = cls.run

            def run(self, *a, _orig=orig, **kw):
                if not tally["inside"]:
                    fn = getattr(self, "fn", None) or self
                    key = f"triton.{getattr(fn, '__name__', 'kernel')}"
                    tally["ops"][key] = tally["ops"].get(key, 0) + 1
                tally["inside"] += 1
                try:
                    return _orig(self, *a, **kw)
                finally:
                    tally["inside"] -= 1

            cls.run = run
            patched.append((cls, orig))
    except ImportError:
        pass
    try:
        with _Counter(tally):
            yield tally
    finally:
        for cls, orig in patched:
            cls.run = orig


def total(tally) -> int:
    return sum(tally["ops"].values())


def cuda_kernels(fn, steps: int = 3) -> tuple[float, dict]:
    """(kernels per call, {kernel name: per call}) of fn() on CUDA, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    names = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            names[ev.key[:80]] = ev.count / steps
    return sum(names.values()), names


def step_counts(kind: str, num_layers: int | None = None, device: str = "cpu", batch: int = 1) -> dict:
    """Launches of one decode step of `batch` lanes of the Gemma 4 `kind` ("31b", "26b-a4b", "e2b",
    "e4b"), its real layer pattern: {"fused": n, "modules": n, "torch": n, "layers": L, "top": ...}.
    "fused": the fused forward (gpu/step.py); "modules": the GPU path module by module
    (NINFER_GEMMA4_FUSE=0); "torch": the CPU reference. On the CPU (TRITON_INTERPRET=1 for the
    first two) at shrunk widths; on CUDA at the real widths of the 31B and 26B-A4B, counted from
    the profiler. What is counted is the CUDA-Graph decode's body (`DecodeGraphs._body`, the
    launches a graph replay runs; its input copies are outside), run eagerly at position 10 (the
    same step each time: its K/V rows are rewritten). Counts do not depend on the widths."""
    import os

    from ninfer_core.engine.model_api import DECODE, ForwardBatch, LaneSegment, RunnerOptions
    from ninfer_gemma4 import layers as L
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.gpu import step
    from ninfer_gemma4.gpu.random_model import RandomArtifact
    from ninfer_gemma4.testing import REAL, shrunk_config

    dev = torch.device(device)
    if dev.type == "cuda" and kind in ("31b", "26b-a4b"):
        from ninfer_gemma4.shapes import real_config

        cfg = real_config(kind, num_layers=num_layers)
        cfg["max_position_embeddings"] = 8192
        dtype = torch.bfloat16
    else:
        cfg = shrunk_config(kind, num_layers=num_layers or REAL[kind]["num_hidden_layers"], window=8,
                            multimodal=False)
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    runner = Gemma4Family().load(RandomArtifact(cfg, device=dev, dtype=dtype), device=device, dtype=dtype)
    if dev.type != "cuda":
        step.prepare(runner.model)
    runner.configure(RunnerOptions(max_segment_tokens=16, cuda_graph=False))
    runner.allocate_cache(8 * batch, batch, page_size=16)
    groups = runner.cache_spec().group_names
    tabs = [{g: list(range(i * 8, i * 8 + 8)) for g in groups} for i in range(batch)]
    runner.forward(ForwardBatch([LaneSegment(i, tabs[i], 0, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]) for i in range(batch)]))
    from ninfer_gemma4.gpu.graphs import DecodeGraphs

    graphs = DecodeGraphs(runner)  # the CUDA-Graph decode's body over its device buffers, run eagerly
    graphs._fill(graphs.rows([LaneSegment(i, tabs[i], 10, [20 + i], DECODE) for i in range(batch)]))

    def decode():
        return graphs._body(batch)

    res = {"layers": cfg["num_hidden_layers"], "kind": kind, "device": device, "batch": batch}
    kernels = L._use_kernels
    old = os.environ.get("NINFER_GEMMA4_FUSE")
    try:
        for mode in ("fused", "modules", "torch"):
            os.environ["NINFER_GEMMA4_FUSE"] = "0" if mode == "modules" else "1"
            if mode == "torch":
                if dev.type == "cuda":
                    continue
                L._use_kernels = lambda x: False
            if dev.type == "cuda":
                with torch.inference_mode():
                    n, names = cuda_kernels(decode)
                res[mode], res[f"{mode}_top"] = round(n), sorted(names.items(), key=lambda kv: -kv[1])[:12]
            else:
                with torch.inference_mode():
                    decode()
                    with counting() as tally:
                        decode()
                res[mode] = total(tally)
                res[f"{mode}_top"] = sorted(tally["ops"].items(), key=lambda kv: -kv[1])[:12]
    finally:
        L._use_kernels = kernels
        if old is None:
            os.environ.pop("NINFER_GEMMA4_FUSE", None)
        else:
            os.environ["NINFER_GEMMA4_FUSE"] = old
    return res


def render(res: dict) -> str:
    n = res["layers"]
    parts = [f"{m} {res[m]} ({res[m] / n:.1f}/layer)" for m in ("fused", "modules", "torch") if m in res]
    return f"gemma4 {res['kind']} decode step b{res['batch']} launches on {res['device']} ({n} layers): " + ", ".join(parts)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="launches of one Gemma 4 decode step, fused and not")
    ap.add_argument("--kinds", default="26b-a4b,31b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the real count)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", action="store_true", help="also list the most frequent launches")
    a = ap.parse_args(argv)
    for kind in a.kinds.split(","):
        res = step_counts(kind, a.layers or None, a.device, a.batch)
        print(render(res), flush=True)
        if a.top:
            for m in ("fused", "modules", "torch"):
                if m in res:
                    print(f"  {m}: " + ", ".join(f"{k} x{v:g}" for k, v in res[f"{m}_top"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
