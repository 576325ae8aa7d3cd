"""Evaluate a ninfer-tiny artifact: through a live `ninfer serve` with the openai client, plus offline
MTP acceptance and prose perplexity with the qwen35 plugin's runner.

    python -m ninfer_tiny.evaluate --artifact runs/tiny/ninfer-tiny.ninfer   # starts its own server
    python -m ninfer_tiny.evaluate --base-url http://127.0.0.1:8080/v1 --artifact A.ninfer

Held-out prompts come from `ninfer_tiny.data.eval_prompts` (their own seed streams), answered
greedily (temperature 0, thinking on as trained). Scores:
- tool: the server's parsed tool_calls (the shared parser) has a call to the expected function
  with exactly the expected argument names;
- json: the answer content is valid JSON matching the schema (required keys, declared types, no
  extra keys; no grammar is used);
- addition: the last integer in the answer equals a + b (a, b below 100);
- mtp: greedy MTP first-draft acceptance, offline (the server has no MTP backend yet): after the
  prompt, decode greedily with the runner; at each step the MTP head drafts the token after the
  next one from (next token, hidden state) and it counts as accepted when it equals the greedy
  token the main model then picks;
- ppl: perplexity of the held-out prose documents (first 512 tokens of each).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time

TARGETS = {"tool": 0.9, "json": 0.9, "addition": 0.9, "mtp": 0.6}
_LISTEN = re.compile(r"listening on http://[0-9.]+:(\d+)")


def matches_schema(value, schema: dict) -> bool:
    """The JSON-schema subset the generator writes: an object of typed required properties."""
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict}
    if not isinstance(value, dict):
        return False
    props = schema.get("properties", {})
    if set(value) - set(props) or any(k not in value for k in schema.get("required", [])):
        return False
    for k, v in value.items():
        want = props[k].get("type")
        if isinstance(v, bool) and want in ("integer", "number"):
            return False
        if want in kinds and not isinstance(v, kinds[want]):
            return False
    return True


def score_answer(sample, message) -> bool:
    """Whether one chat completion message answers one held-out sample correctly."""
    if sample.kind == "tool":
        calls = message.tool_calls or []
        if not calls:
            return False
        call = calls[0].function
        try:
            args = json.loads(call.arguments)
        except ValueError:
            return False
        return call.name == sample.expect["name"] and set(args) == set(sample.expect["arguments"])
    text = (message.content or "").strip()
    if sample.kind == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return matches_schema(value, sample.expect["schema"])
    if sample.kind == "addition":
        nums = re.findall(r"-?\d+", text)
        return bool(nums) and int(nums[-1]) == sample.expect["answer"]
    raise ValueError(f"no scorer for {sample.kind!r}")


def server_scores(base_url: str, samples, max_tokens: int = 160) -> dict[str, float]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    hits: dict[str, list[bool]] = {}
    for s in samples:
        kw = {"tools": s.tools} if s.tools else {}
        r = client.chat.completions.create(model=model, messages=s.prompt_messages(), temperature=0,
                                           max_tokens=max_tokens, **kw)  # fmt: skip
        hits.setdefault(s.kind, []).append(score_answer(s, r.choices[0].message))
    return {k: sum(v) / len(v) for k, v in hits.items()}


def offline_scores(artifact_path: str, samples, prose_docs: int, gen_tokens: int = 48, options=None) -> dict[str, float]:
    """(mtp acceptance, prose perplexity) with the qwen35 plugin's runner on the CPU; `options` is
    the family's load options (e.g. `kv_dtype`, as `ninfer serve --kv-dtype` passes it)."""
    import torch
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import SeqView
    from ninfer_core.tokenizer.bpe import Tokenizer
    from ninfer_tiny import prose
    from ninfer_tiny.data import project_template

    art = Artifact.open(artifact_path)
    runner = Qwen35Family().load(art, device="cpu", dtype="float32", options=options)
    tok = Tokenizer(art.tokenizer_section)
    page = 16
    max_len = 2048
    n_pages = max_len // page
    runner.allocate_cache(num_pages=n_pages + 1, num_slots=1, page_size=page)
    pages = list(range(n_pages))
    eos = set(runner.eos_token_ids) if hasattr(runner, "eos_token_ids") else set()

    def run(tokens: list[int], cached: int) -> torch.Tensor:
        return runner.forward_hidden([SeqView(slot=0, pages=pages, num_cached=cached)], [tokens])

    accepted = total = 0
    with torch.inference_mode():
        for s in samples:
            ids = project_template().render_ids(tok, s.prompt_messages(), tools=s.tools)[: max_len - gen_tokens]
            runner.reset_slot(0)
            hidden = [run(ids, 0)]
            seq = list(ids)
            for _ in range(gen_tokens):
                nxt = int(runner.logits(hidden[-1][-1:]).argmax(-1)[0])
                seq.append(nxt)
                if nxt in eos:
                    break
                hidden.append(run([nxt], len(seq) - 1))
            h = torch.cat(hidden)  # [len(seq) - 1 or len(seq), H]: hidden[t] for t < len(h)
            p = len(ids)
            if len(seq) - p < 2:
                continue
            # drafts for positions p+1 .. len(seq)-1 from (seq[t+1], h[t]), t = p-1 .. len(seq)-3
            t0, t1 = p - 1, len(seq) - 2
            logits, _, _ = runner.mtp_forward(seq[t0 + 1 : t1 + 1], h[t0:t1], start=t0 + 1)
            drafts = logits.argmax(-1).tolist()
            truth = seq[t0 + 2 : t1 + 2]
            accepted += sum(int(a == b) for a, b in zip(drafts, truth))
            total += len(truth)
        _, held = prose.split()
        nll = n = 0.0
        for d in held[:prose_docs]:
            ids = tok.encode(d, allow_special=False)[:512]
            if len(ids) < 2:
                continue
            runner.reset_slot(0)
            logits = runner.logits(run(ids, 0)).float()
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
            n += len(ids) - 1
    art.close()
    return {"mtp": accepted / total if total else 0.0, "ppl": math.exp(nll / n) if n else float("nan")}


def start_server(artifact: str, extra_args=()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ninfer_core.cli", "serve", artifact, "--host", "127.0.0.1", "--port", "0",
           *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = None
    for line in proc.stdout:
        m = _LISTEN.search(line)
        if m:
            port = m.group(1)
            break
    if port is None:
        proc.wait(30)
        raise RuntimeError(f"server did not start (rc={proc.returncode})")
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain the pipe
    import httpx

    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=10).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited (rc={proc.returncode})")
        time.sleep(0.1)
    return proc, base + "/v1"


def format_table(scores: dict[str, float], n: int) -> str:
    rows = [("tool call (right function, argument names)", "tool"), ("JSON matching the schema", "json"),
            ("addition a + b, a, b < 100", "addition"), ("greedy MTP first-draft acceptance", "mtp")]
    lines = [f"| metric ({n} prompts each) | score | target |", "|---|---|---|"]
    for label, key in rows:
        lines.append(f"| {label} | {scores.get(key, float('nan')):.3f} | {TARGETS[key]:.1f} |")
    lines.append(f"| held-out prose perplexity | {scores.get('ppl', float('nan')):.2f} | reported |")
    return "\n".join(lines)


def evaluate(artifact: str, base_url: str | None = None, per_kind: int = 50, seed: int = 1,
             prose_docs: int = 40, max_tokens: int = 160) -> dict[str, float]:
    """Run every score; starts (and stops) a server on the artifact when base_url is None."""
    from ninfer_tiny.data import eval_prompts

    samples = eval_prompts(seed, per_kind)
    proc = None
    try:
        if base_url is None:
            proc, base_url = start_server(artifact)
        scores = server_scores(base_url, samples, max_tokens)
    finally:
        if proc is not None:
            proc.terminate()  # SIGTERM stops at once; a single SIGINT waits for a confirming second one
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    scores.update(offline_scores(artifact, samples, prose_docs))
    return scores


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninfer_tiny.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--artifact", required=True, help="the .ninfer artifact (offline scores; served if no --base-url)")
    p.add_argument("--base-url", default=None, help="an already running server's /v1 URL")
    p.add_argument("--per-kind", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prose-docs", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--json", dest="json_out", default=None, help="also write the scores here")
    a = p.parse_args(argv)
    scores = evaluate(a.artifact, a.base_url, a.per_kind, a.seed, a.prose_docs, a.max_tokens)
    print(format_table(scores, a.per_kind))
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump(scores, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
