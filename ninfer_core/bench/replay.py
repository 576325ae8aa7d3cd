"""`ninfer bench --conversations`: replay scripted agent sessions through the context cache.

The project generates the sessions (seeded, no data downloaded): an append-only multi-turn chat, a
tool loop, a regenerated last reply, an edited last user message, a branch from an earlier turn,
two clients sharing a system prompt, and an Anthropic-shaped session with cache_control markers.
Each turn is rendered with the chat template, served by an Engine with the checkpoint catalog, and
(for the time to first token) served again from root by a second, root-only Engine over the same
weights. The assistant's reply in the next turn's history is the text the model generated, as a
client would send it back.

Printed per scenario: prompt tokens reused / prompt tokens over the turns after the first, the
reuse of the previous turn's prompt (append-only and tool-loop turns), the distance from the
divergence point to the resumed frontier (regenerate, edit, branch), and the median time to first
token warm / cold, all measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

WORDS = ["cache", "kernel", "state", "page", "token", "prefix", "anchor", "branch", "window", "layer", "tensor", "request", "stream", "lane", "engine", "slot", "queue", "frontier", "digest", "checkpoint", "image", "host", "device", "memory", "budget", "planner"]


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", action="store_true",
                   help="replay scripted agent sessions through the context cache and print reuse and TTFT")
    p.add_argument("--turns", type=int, default=6, help="turns per scripted session")
    p.add_argument("--system-tokens", type=int, default=1500, help="approximate system prompt size")
    p.add_argument("--reply-tokens", type=int, default=48, help="tokens generated per turn")
    p.add_argument("--replay-model", default="default",
                   help="model of the replay: 'default' (the small model `ninfer serve` builds), a shape name "
                        "(random weights on the device) or a .ninfer path")
    p.add_argument("--replay-context", type=int, default=32768, help="--max-context of the replay engine")
    p.add_argument("--replay-chunk", type=int, default=1024, help="--prefill-chunk of the replay engine")
    p.add_argument("--auto-long-anchors", action="store_true", help="serve with --auto-long-anchors")
    p.add_argument("--branch-anchors", action="store_true", help="serve with --branch-anchors")
    p.add_argument("--profile-replay", action="store_true",
                   help="time the phases of every warm turn (admission, state restore and capture, page copies, "
                        "each prefill chunk; the device synchronised around each) and print them per scenario")


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Turn:
    messages: list[dict]
    tools: list[dict] | None = None
    markers: list[str] = field(default_factory=list)  # message texts whose end is a cache marker
    diverges_at: str | None = None  # the message text where this turn departs from the previous one
    kind: str = "append"  # append | regenerate | edit | branch | first
    client: int = 0  # sessions of different clients interleave; "previous turn" is per client


@dataclass
class Scenario:
    name: str
    turns: list  # list[Turn] or callables(prev_reply_texts) -> Turn


# -- sessions ---------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def build_scenarios(rng: random.Random, turns: int, system_tokens: int, tok) -> list[tuple[str, Any]]:
    """Each scenario is a function (serve) -> None that calls serve(Turn) per turn and reads back
    the reply text. The system prompt is grown to about `system_tokens` tokens of `tok`."""
    words = []
    while len(tok.encode(" ".join(words))) < system_tokens:
        words += _text(rng, 64).split()
    system = {"role": "system", "content": " ".join(words)}

    def user(n=40):
        return {"role": "user", "content": _text(rng, n)}

    def append_only(serve):
        msgs = [system, user()]
        for i in range(turns):
            reply = serve(Turn(list(msgs), kind="first" if i == 0 else "append"))
            msgs += [{"role": "assistant", "content": reply}, user()]

    def tool_loop(serve):
        msgs = [system, user()]
        for i in range(turns):
            serve(Turn(list(msgs), tools=TOOLS, kind="first" if i == 0 else "append"))
            call = {"role": "assistant", "content": "",
                    "tool_calls": [{"id": f"call_{i}", "type": "function",
                                    "function": {"name": "read_file", "arguments": {"path": f"src/m{i}.py"}}}]}
            msgs += [call, {"role": "tool", "tool_call_id": f"call_{i}", "content": _text(rng, 150)}]

    def regenerate(serve):
        msgs = [system, user()]
        for i in range(turns - 1):
            reply = serve(Turn(list(msgs), kind="first" if i == 0 else "append"))
            msgs += [{"role": "assistant", "content": reply}, user()]
        last_user = msgs[-1]["content"]
        serve(Turn(list(msgs), kind="regenerate", diverges_at=None))
        serve(Turn(list(msgs), kind="regenerate", diverges_at=last_user))

    def edit_last(serve):
        msgs = [system, user()]
        for i in range(turns - 1):
            reply = serve(Turn(list(msgs), kind="first" if i == 0 else "append"))
            msgs += [{"role": "assistant", "content": reply}, user()]
        edited = dict(user())
        serve(Turn(msgs[:-1] + [edited], kind="edit", diverges_at=edited["content"]))

    def branch(serve):
        msgs = [system, user()]
        history = []
        for i in range(turns):
            reply = serve(Turn(list(msgs), kind="first" if i == 0 else "append"))
            history.append(list(msgs) + [{"role": "assistant", "content": reply}])
            msgs += [{"role": "assistant", "content": reply}, user()]
        at = history[turns // 2]
        fork = user()
        serve(Turn(at + [fork], kind="branch", diverges_at=fork["content"]))

    def shared_system(serve):
        a, b = [system, user()], [system, user()]
        for i in range(turns // 2):
            for client, msgs in enumerate((a, b)):
                reply = serve(Turn(list(msgs), kind="first" if i == 0 else "append", client=client))
                msgs += [{"role": "assistant", "content": reply}, user()]
        serve(Turn([system, user()], kind="shared", client=2))  # a third client over the published prefix

    def anthropic_markers(serve):
        msgs = [system, user()]
        for i in range(turns):
            marked = [system["content"], msgs[-1]["content"]]  # cache_control on system and last user block
            reply = serve(Turn(list(msgs), markers=marked, kind="first" if i == 0 else "append"))
            msgs += [{"role": "assistant", "content": reply}, user()]

    return [("append_only", append_only), ("tool_loop", tool_loop), ("regenerate_last", regenerate),
            ("edit_last_user", edit_last), ("branch_earlier_turn", branch),
            ("two_clients_shared_system", shared_system), ("anthropic_cache_control", anthropic_markers)]


# -- serving ---------------------------------------------------------------------------------------
def _marker_positions(tok, template, turn: Turn, ids: list[int]) -> list[int]:
    """Token frontiers right after each marked message (found by rendering the prefix up to it)."""
    out = []
    for text in turn.markers:
        for i, m in enumerate(turn.messages):
            if m.get("content") == text:
                prefix = tok.encode(template.render(turn.messages[: i + 1], tools=turn.tools,
                                                    add_generation_prompt=False, enable_thinking=False))
                if ids[: len(prefix)] == prefix:
                    out.append(len(prefix))
                break
    return out


def _divergence(tok, template, turn: Turn, ids: list[int], previous: list[int] | None) -> int | None:
    if previous is None:
        return None
    n = 0
    for a, b in zip(ids, previous):
        if a != b:
            break
        n += 1
    return n


async def _generate(engine, ids, hints, max_tokens):
    from ninfer_core.engine.api import GenerationRequest, SamplingParams

    handle = engine.submit(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0.0),
                                             max_tokens=max_tokens, checkpoint_hints=hints, ignore_eos=True))
    out, fin = [], None
    async for ev in handle.events():
        if ev.kind == "delta":
            out.extend(ev.token_ids)
        elif ev.kind == "finish":
            fin = ev
        elif ev.kind == "error":
            raise RuntimeError(ev.error.message)
    return out, fin


class PhaseTimer:
    """--profile-replay: wraps the runner's and the catalog's calls with device-synchronised wall
    clocks. `events` collects (phase, ms, detail) for the request being served."""

    RUNNER = ("forward", "commit", "restore_state", "capture_state", "copy_slot", "copy_page", "read_pages",
              "write_pages", "reset_slot")
    CACHE = ("make_room", "admit", "materialize", "reserve_capture_slot", "capture_reserved", "after_chunk",
             "on_finish")

    def __init__(self, runner, cache):
        self.events: list[tuple[str, float, str]] = []
        self._sync = _device_sync(runner)
        dev = getattr(runner, "device", None)
        self._track = getattr(dev, "type", "cpu") == "cuda"  # name what a forward compiled
        self._depth = 0
        for name in self.RUNNER:
            if hasattr(runner, name):
                setattr(runner, name, self._wrap(name, getattr(runner, name)))
        for name in self.CACHE:
            if cache is not None and hasattr(cache, name):
                setattr(cache, name, self._wrap("cache." + name, getattr(cache, name)))

    def _wrap(self, name, fn):
        import time

        def timed(*args, **kw):
            label, detail = name, ""
            segs = getattr(args[0], "segments", None) if name == "forward" and args else None
            if segs:  # a forward: named by what it runs (prefill chunk, decode round, verify round)
                kind = segs[0].kind
                label = "prefill_with_snapshot" if kind == "prefill" and segs[0].snapshot else kind
                if kind == "prefill":
                    detail = f"start={segs[0].start} T={len(segs[0].tokens)}"
                    if segs[0].snapshot:
                        detail += f" capture at +{segs[0].snapshot[0]}"
            before = self._kernels() if label.startswith("prefill") and self._track else None
            self._sync()
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self._sync()
                ms = (time.perf_counter() - t0) * 1e3
                self._depth -= 1
                if before is not None:
                    new = sorted({os.path.basename(f).rsplit(".", 1)[0] for f in self._kernels() - before})
                    if new:
                        detail += f" [compiled in the call: {', '.join(new)}]"
                self.events.append((label, ms, detail))
        return timed

    @staticmethod
    def _kernels() -> set[str]:
        """The compiled kernel binaries in Triton's on-disk cache (a first-use compile adds one)."""
        root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
        found = set()
        for d, _, files in os.walk(root):
            found.update(os.path.join(d, f) for f in files if f.endswith((".cubin", ".hsaco")))
        return found

    def take(self) -> list[tuple[str, float, str]]:
        ev, self.events = self.events, []
        return ev


def _device_sync(runner):
    dev = getattr(runner, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def _phase_table(events: list[tuple[str, float, str]], prompt_ms: float) -> str:
    """One warm turn's phases up to its first token (decode and on_finish come after it)."""
    lines = []
    before_first = []
    for name, ms, detail in events:
        if name in ("decode", "cache.on_finish"):
            break
        before_first.append((name, ms, detail))
    # nested calls (the catalog's copies inside materialize / after_chunk) are listed indented
    total_top = 0.0
    for name, ms, detail in before_first:
        top = name.startswith("cache.") or name == "prefill"
        if top:
            total_top += ms
        lines.append(f"    {'' if top else '  '}{name:<22} {ms:>9.1f} ms  {detail}")
    lines.append(f"    {'sum of top-level phases':<22} {total_top:>9.1f} ms; prompt_ms (admission to first token) "
                 f"{prompt_ms:.1f}")
    return "\n".join(lines)


def _warm_up(eng, tok, template, turns: int = 2, system_tokens: int = 2600) -> None:
    """A short cached conversation before measuring: compiles the kernels for unaligned resumed
    prefixes and capture splits, captures the decode graph, and exercises state capture/restore,
    so no measured turn pays a first use."""
    from ninfer_core.engine.cache import derive_hints

    rng = random.Random(12345)
    words = []
    while len(tok.encode(" ".join(words))) < system_tokens:
        words += _text(rng, 64).split()
    msgs = [{"role": "system", "content": " ".join(words)}, {"role": "user", "content": _text(rng, 37)}]
    for _ in range(turns):
        ids = tok.encode(template.render(msgs, add_generation_prompt=True, enable_thinking=False))
        out, _ = asyncio.run(_generate(eng, ids, derive_hints(tok, ids), 4))
        msgs += [{"role": "assistant", "content": tok.decode(out)}, {"role": "user", "content": _text(rng, 53)}]
    asyncio.run(_generate(eng, tok.encode("warm up " * 64), None, 2))


def run_replay(a: argparse.Namespace) -> int:
    """One cached Engine serves every turn; after each scenario the catalog is audited and cleared
    (the pools must be idle), and the scenario's last prompt is served again from root for the
    cold time to first token."""
    from ninfer_core.artifact import Artifact
    from ninfer_core.bench.shapes import shapes
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.cache import derive_hints
    from ninfer_core.engine.engine import Engine
    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.server.serve import cache_dir
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_format import attach
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    device = "cpu" if a.device.startswith("cuda") and not _cuda() else a.device
    host = PluginHost(PluginSelection.from_sources(a.plugin))
    try:
        model = a.replay_model
        SHAPES = shapes(host)
        if model in SHAPES:
            reg = host.family_for_architecture(SHAPES[model]["model_type"])
            target = reg.load()
            family = target() if isinstance(target, type) else target
            art = family.random_artifact(SHAPES[model], device=device, seed=a.seed)
        else:
            path = model if model != "default" else host.default_artifact(str(cache_dir()))
            art = Artifact.open(path)
            reg = host.family_for_architecture(art.architecture)
            target = reg.load()
            family = target() if isinstance(target, type) else target
    except Exception as e:  # noqa: BLE001 - reported, exit 1
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    tok = Tokenizer.from_section(art.tokenizer_section)
    if hasattr(family, "chat_format"):  # the family's markup (turn opener of the derived hints)
        attach(tok, family.chat_format(art))
    source = getattr(art, "chat_template", None) or getattr(family, "chat_template", None)
    if not source:
        print("error: the model has no chat template (neither the artifact nor its family has one)",
              file=sys.stderr)
        return 1
    template = ChatTemplate(source)
    ctx_len = a.replay_context
    eng = Engine(family.load(art, device=device), tok, EngineOptions(
        max_context=ctx_len, kv_capacity=2 * ctx_len, prefill_chunk=a.replay_chunk, max_concurrency=1,
        prefix_reuse=True, auto_long_anchors=a.auto_long_anchors, branch_anchors=a.branch_anchors,
        max_private_continuations=8))
    eng.start()
    rng = random.Random(a.seed)
    rows = []
    idle = True
    print(f"replay: {getattr(art, 'name', a.replay_model)} on {device}, {a.turns} turns per session, system prompt "
          f"~{a.system_tokens} tokens, reply {a.reply_tokens} tokens, auto_long_anchors={a.auto_long_anchors} "
          f"branch_anchors={a.branch_anchors}", flush=True)

    def clear_and_check() -> bool:
        with eng._cv:
            eng.cache.audit(list(eng.scheduler.lanes))
        eng.run_control(eng.cache.clear).result(120)
        snap = eng.snapshot()
        cc = snap["context_cache"]
        return (snap["pages_free"] == snap["pages_total"] and snap["slots_free"] == snap["slots_total"]
                and cc["checkpoints"] == 0 and cc["device_state_slots_used"] == 0
                and cc["host_state_slots_used"] == 0 and cc["host_kv_bytes_used"] == 0)

    timer = PhaseTimer(eng.runner, eng.cache) if getattr(a, "profile_replay", False) else None
    if timer is not None and getattr(eng.runner, "info", None) is not None and "warmup_ms" in eng.runner.info.extra:
        print(f"runner warm-up at allocation (ms): {eng.runner.info.extra['warmup_ms']}", flush=True)
    profiles = []
    try:
        # Warm up kernels and allocator once so neither side pays first-use costs.
        _warm_up(eng, tok, template)
        clear_and_check()
        if timer is not None:
            timer.take()
        for name, script in build_scenarios(rng, a.turns, a.system_tokens, tok):
            stats = {"prompt": 0, "reused": 0, "warm_ms": [], "prev_ratio": [], "gap": [], "sources": {}}
            last_of: dict[int, list[int]] = {}
            state = {"first": True, "last_ids": None, "last_warm": 0.0}

            def serve(turn: Turn, stats=stats, last_of=last_of, state=state) -> str:
                previous = last_of.get(turn.client)
                ids = tok.encode(template.render(turn.messages, tools=turn.tools, add_generation_prompt=True,
                                                 enable_thinking=False))
                hints = derive_hints(tok, ids)
                hints.markers = _marker_positions(tok, template, turn, ids)
                before = dict(eng.snapshot()["context_cache"]["selections"])
                if timer is not None:
                    timer.take()
                out, fin = asyncio.run(_generate(eng, ids, hints, a.reply_tokens))
                if timer is not None:
                    state["events"] = timer.take()
                after = eng.snapshot()["context_cache"]["selections"]
                source = next((k for k in after if after[k] != before[k]), "?")
                cached = fin.usage.cached_tokens
                if not state["first"]:
                    stats["prompt"] += len(ids)
                    stats["reused"] += cached
                    stats["warm_ms"].append(fin.timings["prompt_ms"])
                    stats["sources"][source] = stats["sources"].get(source, 0) + 1
                    if turn.kind == "append" and previous is not None:
                        stats["prev_ratio"].append(min(cached, len(previous)) / len(previous))
                    if turn.kind in ("regenerate", "edit", "branch"):
                        div = _divergence(tok, template, turn, ids, previous)
                        stats["gap"].append((div if div is not None else len(ids)) - cached)
                    state["last_ids"], state["last_warm"] = ids, fin.timings["prompt_ms"]
                    state["last_events"] = state.get("events", [])
                state["first"] = False
                last_of[turn.client] = ids
                return tok.decode(out)

            script(serve)
            idle = clear_and_check() and idle
            _, cold = asyncio.run(_generate(eng, state["last_ids"], None, 1))  # the last prompt from root
            cold_ms = cold.timings["prompt_ms"]
            idle = clear_and_check() and idle
            if timer is not None:
                timer.take()
                profiles.append((name, state.get("last_events", []), state["last_warm"], cold_ms))
            w = statistics.median(stats["warm_ms"])
            rows.append({"scenario": name, "reused": stats["reused"], "prompt": stats["prompt"],
                         "reuse_ratio": stats["reused"] / max(stats["prompt"], 1),
                         "prev_turn_reuse_min": min(stats["prev_ratio"]) if stats["prev_ratio"] else None,
                         "divergence_gap_max": max(stats["gap"]) if stats["gap"] else None,
                         "last_prompt_tokens": len(state["last_ids"]), "ttft_warm_median_ms": w,
                         "ttft_last_warm_ms": state["last_warm"], "ttft_last_cold_ms": cold_ms,
                         "last_warm_over_cold": state["last_warm"] / cold_ms if cold_ms else None,
                         "sources": stats["sources"]})
    finally:
        eng.shutdown(timeout=120)
    for name, events, warm, cold in profiles:
        print(f"phases of the last warm turn: {name} (warm {warm:.1f} ms, cold {cold:.1f} ms)")
        print(_phase_table(events, warm))
    _print_table(rows)
    print(f"pool accounting after every scenario (catalog cleared): {'idle' if idle else 'NOT IDLE'}")
    if getattr(a, "json", None):
        with open(a.json, "w") as f:
            json.dump({"replay": rows, "idle": idle, "device": device, "model": a.replay_model}, f, indent=2)
    return 0 if idle else 1


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def _print_table(rows: list[dict]) -> None:
    head = (f"{'scenario':<28} {'reused/prompt':>17} {'ratio':>6} {'prev-turn':>9} {'gap':>5} {'last':>6} "
            f"{'TTFT last warm/cold ms':>23} {'w/c':>6}  sources")
    print(head)
    print("-" * len(head))
    for r in rows:
        prev = f"{r['prev_turn_reuse_min']:.3f}" if r["prev_turn_reuse_min"] is not None else "-"
        gap = str(r["divergence_gap_max"]) if r["divergence_gap_max"] is not None else "-"
        src = ", ".join(f"{k}:{v}" for k, v in sorted(r["sources"].items()))
        print(f"{r['scenario']:<28} {r['reused']:>8}/{r['prompt']:<8} {r['reuse_ratio']:>6.3f} {prev:>9} {gap:>5} "
              f"{r['last_prompt_tokens']:>6} {r['ttft_last_warm_ms']:>11.1f}/{r['ttft_last_cold_ms']:<11.1f} "
              f"{r['last_warm_over_cold'] or 0:>6.3f}  {src}")
    print("ratio: prompt tokens reused / prompt tokens over the turns after each session's first; prev-turn: the "
          "least share of the previous turn's prompt an append turn reused; gap: most tokens between the "
          "divergence point and the resumed frontier; last: the last turn's prompt tokens; TTFT: admission to "
          "first token of the last turn, warm (from the cache) and cold (the same prompt after the catalog "
          "was cleared)")
