"""Model suspend on the GPU: waking a sleeping model against loading it cold (issue 18's H200 row).

    python scripts/wake_bench.py --shape qwen3.5-27b --dir /tmp/wake [--repeats 2] [--keep]

Writes a random-weight bf16 artifact of the shape into DIR/models (progress on stderr), then runs
`ninfer serve --models-dir DIR/models --model-suspend --no-cuda-graph --device cuda` (a router of
one model) and, per repeat:

- cold: POST /models/load until GET /models says "loaded" (the artifact is read -- from the page
  cache, since it was just written -- uploaded, and the Engine built);
- a greedy request (its reply and cached_tokens recorded);
- sleep: POST /v1/models/{id}/suspend (device memory copied to host, storages shrunk), then
  wake: POST /v1/models/{id}/resume; the residency report's durations and byte counts;
- the same request again: its reply must equal the first (tokens_cached reported);
- unload (the next repeat's cold load starts from nothing).

Prints one table and a JSON line; exits 1 when a reply after waking differs or the model is not
back to its device bytes. The artifact is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def write_shape_artifact(shape: str, path: Path, device: str, layers: int | None) -> float:
    """A real .ninfer file of `shape` with the bench's random weights (drawn on `device`);
    `layers` keeps only the first N layers (a quick check of this script on the CPU)."""
    import torch

    from ninfer_core.artifact import TensorSpec, write_artifact
    from ninfer_core.bench.shapes import SHAPES
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.random_model import RandomArtifact
    from ninfer_qwen35.testing import minimal_tokenizer_section

    t0 = time.monotonic()
    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
        cfg["layer_types"] = cfg["layer_types"][:layers]
    art = RandomArtifact(cfg, device=torch.device(device), dtype=torch.bfloat16, seed=0,
                         tokenizer_section=minimal_tokenizer_section())
    specs = []
    for name in art.tensor_names():
        shp = art._shapes[name]
        # vectors (norms, GDN's A_log/dt_bias) come in the dtype the random source draws them in
        dtype = art.get_tensor(name).dtype if len(shp) == 1 else torch.bfloat16
        specs.append(TensorSpec(name, dtype, shp, (lambda n=name: art.get_tensor(n))))
    config = {"model_type": cfg.get("model_type", "qwen3_5"), "architectures": ["Qwen3_5ForCausalLM"], **cfg}
    manifest = {"name": path.stem, "architecture": config["model_type"], "config": config,
                "tokenizer": minimal_tokenizer_section(), "chat_template": None,
                "identity": {"model_id": path.stem}, "generation": {}}
    del Qwen35Family  # imported to fail early when the plugin is missing
    write_artifact(str(path), manifest, specs, progress=True)
    return time.monotonic() - t0


def status_of(http: httpx.Client, name: str) -> str:
    for m in http.get("/models").json()["data"]:
        if m["id"] == name:
            st = m["status"]
            return st["value"] if isinstance(st, dict) else st
    raise SystemExit(f"{name} is not in GET /models")


def wait_status(http: httpx.Client, name: str, want: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = status_of(http, name)
        if st == want:
            return time.monotonic() - t0
        if st == "unloaded" and want == "loaded":
            raise SystemExit(f"the load of {name} failed: {http.get('/models').text[:2000]}")
        time.sleep(0.02)
    raise SystemExit(f"{name} did not reach {want!r} in {timeout:.0f} s")


def ask(http: httpx.Client, name: str) -> tuple[list[int], int]:
    body = {"model": name, "prompt": [10 + (i * 7) % 200 for i in range(390)], "max_tokens": 16, "temperature": 0,
            "return_tokens": True, "cache_prompt": True}
    r = http.post("/completion", json=body, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"/completion answered {r.status_code}: {r.text[:1000]}")
    obj = r.json()
    return obj["tokens"], int(obj.get("tokens_cached", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-27b")
    ap.add_argument("--dir", default="/tmp/wake")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=18931)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (a quick check)")
    ap.add_argument("--serve-args", default="", help="more ninfer serve options (e.g. '--suspend-snapshot pinned')")
    ap.add_argument("--artifact", default=None, help="use this artifact instead of writing one (a quick check)")
    a = ap.parse_args()

    models = Path(a.dir) / "models"
    models.mkdir(parents=True, exist_ok=True)
    name = a.shape.replace(".", "") if a.artifact is None else Path(a.artifact).stem
    art = models / f"{name}.ninfer"
    write_s = 0.0
    if a.artifact is not None:
        if not art.exists():
            art.symlink_to(Path(a.artifact).resolve())
    elif not art.exists():
        write_s = write_shape_artifact(a.shape, art, a.device, a.layers)
    size = art.resolve().stat().st_size
    print(f"artifact {art} {size / 1e9:.1f} GB written in {write_s:.1f} s", file=sys.stderr, flush=True)

    log = open(Path(a.dir) / "server.log", "w")
    cmd = [sys.executable, "-m", "ninfer_core.cli", "serve", "--models-dir", str(models), "--model-suspend",
           "--no-cuda-graph", "--device", a.device, "--port", str(a.port), "--no-models-autoload",
           "--max-context", "4096", *a.serve_args.split()]
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    rows, ok = [], True
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=600)
        for _ in range(600):
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        for rep in range(a.repeats):
            t0 = time.monotonic()
            http.post("/models/load", json={"model": name}).raise_for_status()
            wait_status(http, name, "loaded", 600)
            cold = time.monotonic() - t0
            first, _ = ask(http, name)
            resident = http.get(f"/v1/models/{name}/residency").json()
            t0 = time.monotonic()
            r = http.post(f"/v1/models/{name}/suspend", json={})
            r.raise_for_status()
            sleep_wall = time.monotonic() - t0
            asleep = http.get(f"/v1/models/{name}/residency").json()
            t0 = time.monotonic()
            r = http.post(f"/v1/models/{name}/resume", json={})
            r.raise_for_status()
            wake_wall = time.monotonic() - t0
            awake = http.get(f"/v1/models/{name}/residency").json()
            again, cached = ask(http, name)
            same = again == first
            back = awake.get("device_bytes") == resident.get("device_bytes")
            ok = ok and same and back
            rows.append({"repeat": rep, "cold_load_s": round(cold, 3), "sleep_s": round(sleep_wall, 3),
                         "wake_s": round(wake_wall, 3),
                         "suspend_report_s": (awake.get("last_suspend") or {}).get("duration_seconds"),
                         "resume_report_s": (awake.get("last_resume") or {}).get("duration_seconds"),
                         "device_bytes_resident": resident.get("device_bytes"),
                         "device_bytes_asleep": asleep.get("device_bytes"),
                         "device_bytes_awake": awake.get("device_bytes"),
                         "host_snapshot_bytes": asleep.get("host_snapshot_bytes"),
                         "same_reply": same, "cached_after_wake": cached})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            http.post("/models/unload", json={"model": name}).raise_for_status()
            wait_status(http, name, "unloaded", 300)
    finally:
        srv.terminate()
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
        log.close()
        if not a.keep:
            shutil.rmtree(models, ignore_errors=True)

    print(f"{a.shape}: artifact {size / 1e9:.1f} GB")
    print(f"{'rep':>3} {'cold s':>8} {'sleep s':>8} {'wake s':>8} {'wake/cold':>9} {'GB resident':>11} "
          f"{'GB asleep':>9} {'same':>5} {'cached':>6}")
    for r in rows:
        print(f"{r['repeat']:>3} {r['cold_load_s']:>8.2f} {r['sleep_s']:>8.2f} {r['wake_s']:>8.2f} "
              f"{r['wake_s'] / r['cold_load_s']:>9.3f} {(r['device_bytes_resident'] or 0) / 1e9:>11.1f} "
              f"{(r['device_bytes_asleep'] or 0) / 1e9:>9.2f} {str(r['same_reply']):>5} {r['cached_after_wake']:>6}")
    print(json.dumps({"shape": a.shape, "artifact_bytes": size, "rows": rows}))
    return 0 if ok and rows else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
