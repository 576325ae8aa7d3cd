"""Test doubles that honour the core contracts (a toy tokenizer and a toy ModelRunner), and the
pytest plugin that runs the plugin contract suite (ninfer_core.contract; see the end of the file).

`ToyRunner` keeps real paged-KV and state-slot bookkeeping: every token it runs is written into
the KV page row its position maps to, and folded into a rolling hash held in the sequence's state
slot. Before producing logits it reads the whole prefix back out of the pages and checks it
against the slot, so a wrong page table, a shared page, a slot that was not reset or a position
out of step raises instead of passing silently. Logits are a deterministic function of the whole
prefix (or of a `ScriptPolicy`, to force exact outputs).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ninfer_core.engine.api import EngineEvent
from ninfer_core.engine.model_api import (
    LOGITS_ALL,
    LOGITS_LAST,
    PAGE_SIZE,
    VERIFY,
    CacheSpec,
    ForwardBatch,
    KVGroup,
    ModelInfo,
    ModelRunner,
    SegmentOutput,
    SeqView,
    StateImage,
    check_batch,
)
from ninfer_core.engine.spec import DraftLane, Proposal, SpecBackend

# -- tokenizer ----------------------------------------------------------------------------------

_SPECIALS = {256: "<eos>", 257: "<|tool|>"}
_PIECES = {258: b"hello", 259: b" world", 260: b"STOP", 261: b"\xe2\x82"}  # 261 + 0xAC = "€"


class ToyTokenizer:
    """Byte-level tokenizer with the CONTRACTS.md Tokenizer API.

    Ids 0..255 are single bytes, 256 `<eos>` (special, the eos token), 257 `<|tool|>` (special),
    258.. multi-byte pieces, among them 261 = the first two bytes of "€" (its third byte is id 0xAC).
    """

    EOS = 256
    TOOL = 257
    EURO_HEAD = 261

    def __init__(self):
        self.vocab_size = 262
        self.eos_token_ids = (self.EOS,)
        self._bytes = {i: bytes([i]) for i in range(256)}
        self._bytes.update({i: t.encode() for i, t in _SPECIALS.items()})
        self._bytes.update(_PIECES)
        self._by_piece = sorted(((b, i) for i, b in _PIECES.items()), key=lambda p: -len(p[0]))

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        out: list[int] = []
        data = text.encode()
        i = 0
        specials = [(t.encode(), k) for k, t in _SPECIALS.items()] if allow_special else []
        while i < len(data):
            for piece, tid in specials + self._by_piece:
                if data.startswith(piece, i):
                    out.append(tid)
                    i += len(piece)
                    break
            else:
                out.append(data[i])
                i += 1
        return out

    def decode(self, ids, skip_special: bool = True) -> str:
        return b"".join(self.token_bytes(i) for i in ids
                        if not (skip_special and self.is_special(i))).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in _SPECIALS

    def token_to_id(self, text: str) -> int | None:
        for i, b in self._bytes.items():
            if b == text.encode() and (i >= 256 or len(b) == 1):
                return i
        return None


# -- model runner -------------------------------------------------------------------------------

_HASH_BASE = 1_000_003
_HASH_MOD = 2_147_483_647


class ScriptPolicy:
    """Force outputs: after a prompt that starts with `key`, emit `scripts[key]` token by token.

    Past the end of a script, `after` is emitted (None: fall back to the runner's own logits).
    """

    def __init__(self, scripts: dict[tuple[int, ...], Sequence[int]], after: int | None = None):
        self.scripts = sorted(((tuple(k), list(v)) for k, v in scripts.items()), key=lambda kv: -len(kv[0]))
        self.after = after

    def __call__(self, prefix: list[int]) -> int | None:
        for key, cont in self.scripts:
            if tuple(prefix[: len(key)]) == key:
                i = len(prefix) - len(key)
                return cont[i] if i < len(cont) else self.after
        return None


class ToyRunner(ModelRunner):
    """A deterministic toy model over real paged KV and state slots (see the module docstring).

    Hooks for tests: `policy(prefix) -> token | None` forces the next token; `fail_if(kind, views,
    tokens) -> bool` raises an injected RuntimeError; `pause()`/`resume()` hold forwards at their
    start (`entered` is set once a held forward is waiting); `calls` logs every forward as
    (kind, [num_cached per row], number of tokens).
    """

    def __init__(self, vocab_size: int = 262, eos_token_ids: tuple[int, ...] = (ToyTokenizer.EOS,),
                 policy: Callable[[list[int]], int | None] | None = None, salt: int = 0,
                 logit_scale: float = 2.0):
        self.info = ModelInfo("toy", vocab_size, 1 << 20, 8, eos_token_ids=tuple(eos_token_ids))
        self.device = torch.device("cpu")
        self.policy = policy
        self.fail_if: Callable[[str, list[SeqView], list[int]], bool] | None = None
        self.salt = salt
        self.logit_scale = logit_scale
        self.calls: list[tuple[str, list[int], int]] = []
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._gate.set()
        self._pow = torch.ones(1, dtype=torch.int64)
        self.kv: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.page_size = PAGE_SIZE
        self._uncommitted: dict[int, list] = {}

    # contract ---------------------------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kv_groups=(KVGroup("full", (0,), kv_heads=1, head_dim=2, bytes_per_token=32),),
                         state_bytes=16, state_layers=(1,))

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.kv = torch.full((num_pages, page_size, 1, 2), -1, dtype=torch.int64)  # [token, position]
        self.state = torch.full((num_slots, 2), -7, dtype=torch.int64)  # [count, hash]; -7: never reset

    def free_cache(self) -> None:
        self.kv = self.state = None
        self._uncommitted = {}

    def kv_page_tensors(self) -> tuple:
        return (self.kv,) if self.kv is not None else ()

    def reset_slot(self, slot: int) -> None:
        self._uncommitted.pop(slot, None)
        self.state[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        self._uncommitted.pop(dst, None)
        self.state[dst] = self.state[src]

    def copy_page(self, src: int, dst: int) -> None:
        self.kv[dst] = self.kv[src]

    def capture_state(self, slot: int) -> StateImage:
        return StateImage({"state": self.state[slot].clone()})

    def restore_state(self, image: StateImage, slot: int) -> None:
        t = image.tensors.get("state")
        if t is None or tuple(t.shape) != (2,):
            raise ValueError("StateImage does not fit the toy runner")
        self._uncommitted.pop(slot, None)
        self.state[slot] = t

    def read_pages(self, pages):
        return {"kv": self.kv[torch.tensor(list(pages), dtype=torch.int64)].clone()}

    def write_pages(self, pages, data) -> None:
        t = data.get("kv")
        if t is None or tuple(t.shape) != (len(pages), *self.kv.shape[1:]):
            raise ValueError("KV data does not fit the toy runner's pages")
        self.kv[torch.tensor(list(pages), dtype=torch.int64)] = t

    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        check_batch(batch, self.info.vocab_size, self.state.shape[0], self.kv.shape[0], ("full",), self.page_size)
        segs = batch.segments
        views = [SeqView(s.slot, list(s.tables["full"]), s.start) for s in segs]
        self._enter(segs[0].kind, views, [int(t) for s in segs for t in s.tokens])
        pending = [s.slot for s in segs if s.slot in self._uncommitted]
        if pending:
            raise RuntimeError(f"state slots {pending} have an uncommitted verify")
        if len(segs) > 1:
            # Rows may share the full pages of a checkpoint's prefix, never a page they write.
            written = [p for s, v in zip(segs, views) for p in
                       {v.pages[q // self.page_size] for q in range(s.start, s.end)}]
            if len(set(written)) != len(written):
                raise RuntimeError("a forward batch shares a KV page")
        outs = []
        for seg, view in zip(segs, views):
            rows, hist = [], []
            # media rows (identity ids past the vocabulary under side embeddings) fold into it
            covered = seg.side.covered_rows() if seg.side is not None and seg.side.embeddings else ()
            for i, t in enumerate(seg.tokens):
                self._step(view, seg.start + i, int(t) % self.info.vocab_size if i in covered else int(t))
                if seg.kind == VERIFY:
                    hist.append(self.state[seg.slot].clone())
                if seg.snapshot is not None and i + 1 == seg.snapshot[0]:
                    self.state[seg.snapshot[1]] = self.state[seg.slot]
                if seg.logits == LOGITS_ALL or (seg.logits == LOGITS_LAST and i == len(seg.tokens) - 1):
                    rows.append(self._logits(view, seg.start + i + 1))
            if seg.kind == VERIFY:
                self._uncommitted[seg.slot] = hist
            logits = None
            if seg.logits == LOGITS_ALL:
                logits = torch.stack(rows)
            elif seg.logits == LOGITS_LAST:
                logits = rows[0]
            outs.append(SegmentOutput(logits))
        return outs

    def commit(self, kept) -> None:
        for slot, n in kept:
            hist = self._uncommitted.pop(slot, None)
            if hist is None:
                raise RuntimeError(f"state slot {slot} has no verify to commit")
            if not 1 <= n <= len(hist):
                raise ValueError(f"commit of {n} tokens of a verify of {len(hist)}")
            self.state[slot] = hist[n - 1]

    def greedy_continuation(self, tokens: list[int], n: int) -> list[int]:
        """The toy model's own greedy continuation of `tokens` (an oracle drafter's source)."""
        out, seq = [], list(tokens)
        for _ in range(n):
            t = int(self.logits_of(seq).argmax())
            out.append(t)
            seq.append(t)
        return out

    def logits_of(self, tokens: list[int]) -> torch.Tensor:
        """The logits after `tokens`, computed without the cache (the same function forwards use)."""
        if self.policy is not None:
            forced = self.policy(list(tokens))
            if forced is not None:
                logits = torch.zeros(self.info.vocab_size)
                logits[forced] = 50.0
                return logits
        gen = torch.Generator().manual_seed(self._hash(torch.tensor(tokens, dtype=torch.int64)) * 7919 + self.salt)
        return torch.randn(self.info.vocab_size, generator=gen) * self.logit_scale

    # test hooks -------------------------------------------------------------------------------
    def pause(self) -> None:
        self.entered.clear()
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    # internals --------------------------------------------------------------------------------
    def _enter(self, kind: str, views: list[SeqView], tokens: list[int]) -> None:
        self.calls.append((kind, [v.num_cached for v in views], len(tokens)))
        if not self._gate.is_set():
            self.entered.set()
            if not self._gate.wait(60):
                raise RuntimeError("toy runner held for more than 60 s")
        if self.fail_if is not None and self.fail_if(kind, views, tokens):
            raise RuntimeError(f"injected {kind} failure")

    def _step(self, seq: SeqView, pos: int, token: int) -> None:
        if not 0 <= token < self.info.vocab_size:
            raise ValueError(f"token {token} outside the vocabulary")
        if pos // self.page_size >= len(seq.pages):
            raise RuntimeError(f"pages {seq.pages} do not cover position {pos}")
        count, h = (int(v) for v in self.state[seq.slot])
        if count != pos:
            raise RuntimeError(f"state slot {seq.slot} holds {count} tokens, the sequence is at {pos}")
        self.kv[seq.pages[pos // self.page_size], pos % self.page_size, 0] = torch.tensor([token, pos])
        self.state[seq.slot] = torch.tensor([pos + 1, (h * _HASH_BASE + token + 1) % _HASH_MOD])

    def _prefix(self, seq: SeqView, n: int) -> torch.Tensor:
        """The first `n` tokens read back from the pages, checked against the state slot."""
        pos = torch.arange(n)
        page_ids = torch.tensor(seq.pages, dtype=torch.int64)[pos // self.page_size]
        rows = self.kv[page_ids, pos % self.page_size, 0]  # [n, 2]
        if not torch.equal(rows[:, 1], pos):
            raise RuntimeError("KV pages do not hold this sequence's positions (page mapping corrupted)")
        tokens = rows[:, 0]
        if int(self.state[seq.slot, 0]) == n and self._hash(tokens) != int(self.state[seq.slot, 1]):
            raise RuntimeError("KV pages disagree with the state slot (page or slot mapping corrupted)")
        return tokens

    def _hash(self, tokens: torch.Tensor) -> int:
        n = tokens.numel()
        while self._pow.numel() < n:
            grown = self._pow * pow(_HASH_BASE, self._pow.numel(), _HASH_MOD) % _HASH_MOD
            self._pow = torch.cat([self._pow, grown])
        weights = self._pow[:n].flip(0)
        return int(((tokens + 1) * weights % _HASH_MOD).sum() % _HASH_MOD)

    def _logits(self, seq: SeqView, n: int) -> torch.Tensor:
        return self.logits_of(self._prefix(seq, n).tolist())


def runner_continuation(runner: ModelRunner, num_pages: int = 64) -> Callable[[list[int], int], list[int]]:
    """(history, n) -> `runner`'s own greedy continuation of `history`, computed from scratch on that
    runner (give it a runner of its own: its cache is reallocated here). An oracle drafter's source."""
    runner.allocate_cache(num_pages, 1)

    def continuation(history: list[int], n: int) -> list[int]:
        runner.reset_slot(0)
        view = SeqView(0, list(range(num_pages)), 0)
        logits = runner.prefill(view, list(history))
        view.num_cached = len(history)
        out: list[int] = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            if len(out) < n:
                logits = runner.decode([view], [out[-1]])[0]
                view.num_cached += 1
        return out

    return continuation


class OracleDrafter(SpecBackend):
    """A speculative backend for tests and benches: drafts the target's own greedy continuation
    (`target(history) -> list of tokens`, e.g. `ToyRunner.greedy_continuation`), each position
    replaced by another token with probability `corrupt` (a known acceptance rate)."""

    name = "oracle"

    def __init__(self, continuation: Callable[[list[int], int], list[int]], draft_tokens: int = 3,
                 corrupt: float = 0.0, vocab_size: int = 262, seed: int = 0):
        import random

        self.continuation = continuation
        self.draft_tokens = draft_tokens
        self.corrupt = corrupt
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self.rounds: list = []

    def propose(self, lanes: Sequence[DraftLane]) -> list[Proposal]:
        out = []
        for lane in lanes:
            k = min(self.draft_tokens, lane.max_drafts)
            got = self.continuation(list(lane.history), k) if k > 0 else []
            got = [(t + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
                   if self._rng.random() < self.corrupt else t for t in got]
            out.append(Proposal(got))
        return out

    def observe_round(self, report) -> None:
        self.rounds.append(report)


# -- event collection ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """Everything one request's event stream said."""

    events: list[EngineEvent] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e.kind == "delta" for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "delta")

    @property
    def last(self) -> EngineEvent:
        return self.events[-1]

    @property
    def finish(self) -> EngineEvent | None:
        return self.events[-1] if self.events and self.events[-1].kind == "finish" else None

    @property
    def error(self):
        return self.events[-1].error if self.events and self.events[-1].kind == "error" else None


def plugin_flags(entry_point: str, module: str) -> list[str]:
    """`--plugin MODULE` for a `ninfer serve` subprocess unless the package is installed (its entry
    point `entry_point` in group "ninfer" then loads it): a plugin's tests run from a checkout
    on PYTHONPATH as well as from an install."""
    from importlib.metadata import entry_points

    if any(ep.name == entry_point for ep in entry_points(group="ninfer")):
        return []
    return ["--plugin", module]


def run_async(coro, timeout: float = 60.0):
    """Run a coroutine on a fresh event loop with a safety timeout (not a timing assertion)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(handle, on_event: Callable[[EngineEvent], None] | None = None) -> Outcome:
    """Read a handle's events to the end; `on_event` sees each one as it arrives."""
    out = Outcome()
    async for event in handle.events():
        out.events.append(event)
        if on_event is not None:
            on_event(event)
    return out


def wait_server_idle(server, timeout: float = 20.0) -> dict:
    """Poll a live server's GET /v1/load until nothing runs, waits or is admitted; returns that
    report. `server` has a `base_url`. Fails the calling test after `timeout` seconds."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(server.base_url + "/v1/load", timeout=10).json()
        r = load["requests"]
        if r["running"] == 0 and r["admitted"] == 0 and r["waiting"] == 0:
            return load
        assert time.monotonic() < deadline, f"engine did not return to idle: {load}"
        time.sleep(0.05)


# -- pytest plugin ------------------------------------------------------------------------------
# `ninfer_core.testing` is also a pytest plugin (entry point pytest11 of ninfer-core; or
# `-p ninfer_core.testing`): a conftest.py that declares `ninfer_contract = {case id: RunnerContract
# or SpecContract}` gets the contract suite (ninfer_core.contract) collected beside its tests.
# pytest is imported only when pytest calls in, so the doubles above stay importable without it.


def pytest_collect_file(file_path, parent):
    from ninfer_core.contract.pytest_plugin import collect_file

    return collect_file(file_path, parent)


def pytest_pycollect_makemodule(module_path, parent):
    from ninfer_core.contract.pytest_plugin import make_module

    return make_module(module_path, parent)
