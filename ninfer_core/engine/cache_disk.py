"""The disk tier under the Host tier (spec "Disk tier"): `--disk-kv-path`, `--disk-kv-gib`,
`--disk-kv-restore`.

When the catalog evicts a private continuation (pressure or the continuation limit), and for every
continuation still resident at shutdown, it is written here before its memory is released: its KV
pages as a prefix chain, the StateImage at its deepest checkpoint (the endpoint), and the tail page
and StateImage of its rewrite seam (turn closure) and of its three earliest long anchors.

Layout, under DIR/<artifact>/<profile>/ (profile: a digest of the execution facts -- architecture,
sizes, KV dtype and geometry, page size, state geometry -- so one model or KV format never restores
another's pages):

* kv/<digest>.page -- one KV page, keyed by the prefix digest (FNV-1a 64 of the token ids) at its
  last token: a full page at 64(k+1), a checkpoint's partly filled tail page at the checkpoint's
  frontier. An identical prefix is therefore stored once, whoever evicted it. The page file also
  holds the page's own token ids, so a restore verifies the chain token by token.
* state/<digest>-<frontier>.state -- a StateImage at an exact frontier, with the kind of checkpoint
  it was and a SHA-256 of the frontier's tokens.

Each file is `magic | crc32 | header length | header JSON | tensor bytes`, the CRC over everything
after it, written to a temporary name and renamed; a torn or altered file fails its CRC and reads as
a miss (and is deleted). The budget (`--disk-kv-gib`) is split 85/15 between KV pages and
StateImages (no speculative backend KV is kept); the least recently used file of a class goes first.
Files survive restarts (the index is rebuilt from the directory at startup).

With `--disk-kv-restore`, a request with no resident prefix looks for the longest frontier E whose
StateImage and whole KV chain are on disk and match its prompt; it is installed as an ordinary
continuation (so admission reuses it, reported by its checkpoint kind) and the prompt is prefilled
from E. Pages are read by eight threads; a restore is abandoned after 8 seconds, and any miss, CRC
failure or mismatch falls back to a shallower frontier or to recomputing the prompt, so a result
never depends on the disk contents.

Writes are staged (`begin_write`): the evicted continuation keeps its memory until its pages and
StateImages are read out of the engine, `WRITE_BATCH_PAGES` pages at a time between decode rounds
(`pump`, on the engine thread), so a large spill never holds the other lanes' decode for long; the
batches are encoded and written by a background writer. A write not read out within
`WRITE_DEADLINE_S` (20 s) is abandoned (`abandoned_writes`) and the memory released; a restore
first finishes the staged writes and waits for the writer.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer_core.engine import cache_slots
from ninfer_core.engine.checkpoints import FNV_OFFSET, FNV_PRIME, MASK64

log = logging.getLogger("ninfer.engine.cache")

PAGE_MAGIC = b"NKVPAGE1"
STATE_MAGIC = b"NKVSTAT1"
_CRC = struct.Struct("<I")
_LEN = struct.Struct("<Q")
MAIN_SHARE = 0.85  # of --disk-kv-gib for KV pages; the rest holds StateImages (no backend KV)
RESTORE_DEADLINE_S = 8.0
READ_THREADS = 8
ANCHORS_KEPT = 3  # the three earliest long anchors keep their tail page and StateImage
WRITE_BATCH_PAGES = 16  # pages (a StateImage counts as one) read out of the engine per boundary
WRITE_DEADLINE_S = 20.0  # a staged write not read out by then is abandoned
SHUTDOWN_WRITE_S = 60.0


def prefix_digests(tokens, at: set[int]) -> dict[int, str]:
    """FNV-1a 64 digests of tokens[:n] for every n in `at` (one pass)."""
    out: dict[int, str] = {}
    if 0 in at:
        out[0] = f"{FNV_OFFSET:016x}"
    top = max(at, default=0)
    h = FNV_OFFSET
    for i, t in enumerate(tokens[:top], 1):
        h = ((h ^ (int(t) & MASK64)) * FNV_PRIME) & MASK64
        if i in at:
            out[i] = f"{h:016x}"
    return out


def tokens_hash(tokens) -> str:
    return hashlib.sha256(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


def pack(magic: bytes, header: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    table, blob = cache_slots.tensor_blob(sorted(tensors.items()))
    head = json.dumps({**header, "tensors": table}, separators=(",", ":")).encode()
    body = _LEN.pack(len(head)) + head + blob
    return magic + _CRC.pack(zlib.crc32(body)) + body


def unpack(magic: bytes, data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """Verify the CRC first, then parse; ValueError for anything torn, altered or foreign."""
    start = len(magic) + _CRC.size
    if len(data) < start + _LEN.size or data[: len(magic)] != magic:
        raise ValueError("not a disk-tier file of this kind")
    (crc,) = _CRC.unpack_from(data, len(magic))
    body = memoryview(data)[start:]
    if zlib.crc32(body) != crc:
        raise ValueError("CRC mismatch")
    (hlen,) = _LEN.unpack_from(body)
    try:
        header = json.loads(bytes(body[_LEN.size: _LEN.size + hlen]))
        base = _LEN.size + hlen
        tensors = {}
        for t in header["tensors"]:
            raw = bytes(body[base + t["offset"]: base + t["offset"] + t["nbytes"]])
            if len(raw) != t["nbytes"]:
                raise ValueError("tensor bytes out of range")
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors[t["name"]] = buf.view(cache_slots._DTYPES[t["dtype"]]).reshape(t["shape"])
    except (KeyError, TypeError, json.JSONDecodeError, RuntimeError) as e:
        raise ValueError(f"malformed ({e})") from None
    return header, tensors


@dataclass
class DiskFile:
    path: str
    nbytes: int
    last_used: float
    kind: str = ""  # a StateImage's checkpoint kind


@dataclass(eq=False)
class WriteJob:
    """One evicted continuation's staged write: the reads still to do, in order."""

    deepest: Any
    tasks: list  # ("pages", [page index...]) | ("tail", ckpt, digest) | ("state", ckpt, key, kind)
    digests: dict[int, str]
    keys: set  # keys announced as pending (removed as their batches are written)
    deadline: float
    queued: list = field(default_factory=list)  # keys handed to the writer
    files: int = 0

    @property
    def done(self) -> bool:
        return not self.tasks


_PAGE_NAME = re.compile(r"^([0-9a-f]{16})\.page$")
_STATE_NAME = re.compile(r"^([0-9a-f]{16})-(\d+)\.state$")


class DiskTier:
    def __init__(self, root: str, budget_bytes: int, compat: dict, restore: bool):
        profile = hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]
        model = re.sub(r"[^A-Za-z0-9._-]", "_", str(compat.get("model") or "model"))[:96] or "model"
        self.dir = os.path.join(root, model, profile)
        self.kv_dir = os.path.join(self.dir, "kv")
        self.state_dir = os.path.join(self.dir, "state")
        os.makedirs(self.kv_dir, exist_ok=True)
        os.makedirs(self.state_dir, exist_ok=True)
        self.budget = budget_bytes
        self.main_budget = int(budget_bytes * MAIN_SHARE)
        self.state_budget = budget_bytes - self.main_budget
        self.compat = dict(compat)
        self.restore = restore
        self.pages: dict[str, DiskFile] = {}  # digest at the page's last token -> file
        self.states: dict[tuple[str, int], DiskFile] = {}  # (digest, frontier) -> file
        self.counters = {"writes": 0, "write_bytes": 0, "pages_written": 0, "states_written": 0,
                         "restores": 0, "restored_tokens": 0, "misses": 0, "crc_failures": 0,
                         "abandoned": 0, "evicted_files": 0, "write_failures": 0, "write_batches": 0,
                         "abandoned_writes": 0}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._staged = 0  # WriteJobs not yet read out of the engine
        self._pending_keys: set = set()
        self._queue: queue.Queue = queue.Queue()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="ninfer-disk-kv", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """Rebuild the index from the files a previous run left (temporary files are removed)."""
        for d, names in ((self.kv_dir, os.listdir(self.kv_dir)), (self.state_dir, os.listdir(self.state_dir))):
            for name in names:
                path = os.path.join(d, name)
                try:
                    if name.endswith(".tmp"):
                        os.unlink(path)
                        continue
                    st = os.stat(path)
                except OSError:
                    continue
                m = _PAGE_NAME.match(name)
                if m and d == self.kv_dir:
                    self.pages[m.group(1)] = DiskFile(path, st.st_size, st.st_mtime)
                m = _STATE_NAME.match(name)
                if m and d == self.state_dir:
                    self.states[(m.group(1), int(m.group(2)))] = DiskFile(path, st.st_size, st.st_mtime)

    # -- accounting -------------------------------------------------------------------------------
    @property
    def main_bytes(self) -> int:
        return sum(f.nbytes for f in self.pages.values())

    @property
    def state_bytes(self) -> int:
        return sum(f.nbytes for f in self.states.values())

    @property
    def used_bytes(self) -> int:
        return self.main_bytes + self.state_bytes

    def snapshot(self) -> dict:
        with self._lock:
            return {"disk_bytes_used": self.used_bytes, "disk_main_bytes": self.main_bytes,
                    "disk_state_bytes": self.state_bytes, "disk_pages": len(self.pages),
                    "disk_states": len(self.states), "disk_files": len(self.pages) + len(self.states),
                    "budget_bytes": self.budget, **self.counters}

    # -- writing (engine thread: read out; writer thread: encode and write) -------------------------
    def write_continuation(self, cache, cont) -> int:
        """Read a continuation's pages and StateImages out of the engine at once and queue them for
        the writer (shutdown, tests); returns the number of files queued."""
        job = self.begin_write(cache, cont, time.monotonic() + SHUTDOWN_WRITE_S)
        if job is None:
            return 0
        while not job.done:
            self.pump(cache, job, 1 << 30)
        return job.files

    def begin_write(self, cache, cont, deadline: float) -> WriteJob | None:
        """Stage an evicted continuation's write: which pages and StateImages are not on disk yet
        (nothing is read now). None when there is nothing to write. The caller keeps the
        continuation's memory until `pump` reports the job done or it is abandoned."""
        deepest = cont.deepest()
        if deepest is None or deepest.frontier == 0:
            return None
        ps = cache.page_size
        entries = sorted(cont.entries, key=lambda e: e.ckpt.frontier)
        anchors = [e.ckpt for e in entries if e.kind == "long_anchor"][:ANCHORS_KEPT]
        chosen = [deepest] + [e.ckpt for e in entries if e.kind == "turn_closure"] + anchors
        chosen = list({c.id: c for c in chosen if 0 < c.frontier}.values())
        e_front = deepest.frontier
        at = {ps * (k + 1) for k in range(e_front // ps)} | {c.frontier for c in chosen}
        dig = prefix_digests(deepest.tokens, at)
        tasks: list = []
        keys: set = set()
        with self._lock:
            known = set(self.pages) | {k for k in self._pending_keys if isinstance(k, str)}
            known_states = set(self.states) | {k for k in self._pending_keys if isinstance(k, tuple)}
            full = [k for k in range(e_front // ps) if dig[ps * (k + 1)] not in known]
            if full:
                tasks.append(("pages", full))
                keys.update(dig[ps * (k + 1)] for k in full)
            for c in chosen:
                f = c.frontier
                if f % ps and dig[f] not in known and dig[f] not in keys:
                    tasks.append(("tail", c, dig[f]))
                    keys.add(dig[f])
                if (dig[f], f) not in known_states:
                    kind = next(e.kind for e in entries if e.ckpt is c)
                    tasks.append(("state", c, (dig[f], f), kind))
                    keys.add((dig[f], f))
            if not tasks:
                return None
            self._pending_keys.update(keys)
            self._staged += 1
        return WriteJob(deepest, tasks, dig, keys, deadline)

    def pump(self, cache, job: WriteJob, budget: int = WRITE_BATCH_PAGES) -> int:
        """Read up to `budget` pages (a StateImage counts as one) of a staged job out of the engine
        and queue them for the writer; returns what it read."""
        ps = cache.page_size
        used = 0
        batch: list[tuple] = []
        while job.tasks and used < budget:
            task = job.tasks[0]
            if task[0] == "pages":
                take, rest = task[1][: budget - used], task[1][budget - used:]
                data = cache.kv_copy(job.deepest, take)
                for i, k in enumerate(take):
                    end = ps * (k + 1)
                    batch.append(("page", job.digests[end], {"index": k, "rows": ps,
                                                             "tokens": list(job.deepest.tokens[end - ps: end])},
                                  {n: t[i: i + 1] for n, t in data.items()}))
                used += len(take)
                if rest:
                    job.tasks[0] = ("pages", rest)
                    continue
            elif task[0] == "tail":
                c, key = task[1], task[2]
                f = c.frontier
                batch.append(("page", key, {"index": f // ps, "rows": f % ps,
                                            "tokens": list(c.tokens[f - f % ps: f])},
                              cache.kv_copy(c, [f // ps])))
                used += 1
            else:
                c, key, kind = task[1], task[2], task[3]
                image = cache.state_copy(c)
                batch.append(("state", key, {"frontier": c.frontier, "kind": kind,
                                             "tokens_sha": tokens_hash(c.tokens)}, dict(image.tensors)))
                used += 1
            job.tasks.pop(0)
        final = not job.tasks
        if batch:
            job.files += len(batch)
            job.queued.extend(j[1] for j in batch)
            with self._lock:
                self._pending += 1
                if final:
                    self._staged -= 1
            self._queue.put((batch, final))
        elif final:
            with self._lock:
                self._staged -= 1
                self._idle.notify_all()
        return used

    def abandon(self, job: WriteJob) -> None:
        """Give up a staged write past its deadline; what was already queued is still written."""
        if job.done:
            return
        job.tasks = []
        with self._lock:
            self._pending_keys.difference_update(job.keys - set(job.queued))
            self._staged -= 1
            self.counters["abandoned_writes"] += 1
            self._idle.notify_all()
        log.warning("disk tier: an evicted conversation's write was abandoned after %.0f s", WRITE_DEADLINE_S)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            jobs, final = item
            try:
                self._write_jobs(jobs, final)
            except Exception:
                log.exception("disk tier: writing failed")
                with self._lock:
                    self.counters["write_failures"] += 1
            finally:
                with self._lock:
                    self._pending -= 1
                    self._pending_keys.difference_update(j[1] for j in jobs)
                    self._idle.notify_all()

    def _write_jobs(self, jobs: list[tuple], final: bool = True) -> None:
        now = time.time()
        written_keys: set = set()
        n_bytes = 0
        for kind, key, header, tensors in jobs:
            if kind == "page":
                data = pack(PAGE_MAGIC, {"digest": key, **header}, tensors)
                directory, name, budget = self.kv_dir, f"{key}.page", self.main_budget
            else:
                data = pack(STATE_MAGIC, {"digest": key[0], **header}, tensors)
                directory, name, budget = self.state_dir, f"{key[0]}-{key[1]}.state", self.state_budget
            if len(data) > budget:
                continue
            with self._lock:
                self._make_room(kind, len(data), written_keys)
            try:
                cache_slots.write_atomic(directory, name, data)
            except OSError as e:
                log.warning("disk tier: writing %s failed: %s", name, e.strerror)
                with self._lock:
                    self.counters["write_failures"] += 1
                continue
            entry = DiskFile(os.path.join(directory, name), len(data), now, header.get("kind", ""))
            with self._lock:
                if kind == "page":
                    self.pages[key] = entry
                    self.counters["pages_written"] += 1
                else:
                    self.states[key] = entry
                    self.counters["states_written"] += 1
                self.counters["write_bytes"] += len(data)
            written_keys.add(key)
            n_bytes += len(data)
        with self._lock:
            self.counters["write_batches"] += 1
            if final:
                self.counters["writes"] += 1
        log.debug("disk tier: wrote a batch of %d files (%d bytes)%s", len(written_keys), n_bytes,
                  ", the last of a conversation" if final else "")

    def _make_room(self, kind: str, nbytes: int, protect: set) -> None:
        """Under the lock: drop the least recently used files of a class until `nbytes` fit."""
        index = self.pages if kind == "page" else self.states
        budget = self.main_budget if kind == "page" else self.state_budget
        used = sum(f.nbytes for f in index.values())
        while used + nbytes > budget:
            victims = [(f.last_used, k) for k, f in index.items() if k not in protect]
            if not victims:
                return
            _, k = min(victims)
            used -= index[k].nbytes
            self._remove_locked(index, k)

    def _remove_locked(self, index: dict, key) -> None:
        f = index.pop(key, None)
        if f is None:
            return
        self.counters["evicted_files"] += 1
        try:
            os.unlink(f.path)
        except OSError:
            pass

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes; False when they did not finish in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending or self._staged:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = 60) -> None:
        if not self.flush(timeout):
            log.warning("disk tier: pending writes did not finish within %s s", timeout)
        self._queue.put(None)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # -- restore ----------------------------------------------------------------------------------
    def lookup(self, prompt: list[int], now: float | None = None) -> cache_slots.SlotImage | None:
        """The longest frontier E < len(prompt) whose StateImage and KV chain are on disk, intact
        and equal to the prompt's tokens, read as a one-checkpoint SlotImage; None on a miss."""
        if not self.restore:
            return None
        t0 = time.monotonic()
        self.flush(RESTORE_DEADLINE_S)
        ps = self.compat.get("page_size") or 64
        with self._lock:
            frontiers = sorted({f for _, f in self.states if 0 < f < len(prompt)}, reverse=True)
        if not frontiers:
            self._count("misses")
            return None
        top = frontiers[0]
        dig = prefix_digests(prompt, set(frontiers) | {ps * (k + 1) for k in range(top // ps)})
        for f in frontiers:
            if time.monotonic() - t0 > RESTORE_DEADLINE_S:
                self._count("abandoned")
                break
            with self._lock:
                state = self.states.get((dig[f], f))
                keys = [dig[ps * (k + 1)] for k in range(f // ps)] + ([dig[f]] if f % ps else [])
                chain = [self.pages.get(k) for k in keys]
            if state is None or any(c is None for c in chain):
                continue
            image = self._read_chain(prompt, f, keys, chain, state, t0)
            if image is not None:
                stamp = time.time()
                with self._lock:
                    for c in chain + [state]:
                        c.last_used = stamp
                    self.counters["restores"] += 1
                    self.counters["restored_tokens"] += f
                log.info("disk tier: restored a %d-token prefix (%d pages) in %.0f ms", f, len(chain),
                         (time.monotonic() - t0) * 1000)
                return image
        self._count("misses")
        return None

    def _read_chain(self, prompt, f: int, keys: list[str], chain: list[DiskFile], state: DiskFile,
                    t0: float) -> cache_slots.SlotImage | None:
        ps = self.compat.get("page_size") or 64
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ninfer-disk-read")

        def read_page(i: int):
            header, tensors = unpack(PAGE_MAGIC, _read(chain[i].path))
            rows = ps if (i + 1) * ps <= f else f % ps
            if header.get("digest") != keys[i] or header.get("index") != i or header.get("rows") != rows \
                    or header.get("tokens") != list(prompt[i * ps: i * ps + rows]):
                raise ValueError("page does not hold this prefix")
            return tensors

        futures = [self._pool.submit(read_page, i) for i in range(len(chain))]
        pages: list[dict] = []
        failed = None
        for i, fut in enumerate(futures):
            try:
                pages.append(fut.result(timeout=max(0.0, RESTORE_DEADLINE_S - (time.monotonic() - t0))))
            except concurrent.futures.TimeoutError:
                self._count("abandoned")
                return None
            except Exception as e:  # noqa: BLE001 - torn, altered or foreign: a miss
                failed = failed or (i, e)
        if failed is not None:
            i, e = failed
            log.warning("disk tier: page %s is unusable (%s); dropped, the prompt is recomputed from a "
                        "shallower point", os.path.basename(chain[i].path), e)
            with self._lock:
                self.counters["crc_failures"] += 1
                if self.pages.get(keys[i]) is chain[i]:
                    self._remove_locked(self.pages, keys[i])
            return None
        try:
            header, st = unpack(STATE_MAGIC, _read(state.path))
            if header.get("frontier") != f or header.get("tokens_sha") != tokens_hash(prompt[:f]):
                raise ValueError("StateImage does not belong to this prefix")
        except Exception as e:  # noqa: BLE001
            log.warning("disk tier: %s is unusable (%s); dropped", os.path.basename(state.path), e)
            with self._lock:
                self.counters["crc_failures"] += 1
                key = next((k for k, v in self.states.items() if v is state), None)
                if key is not None:
                    self._remove_locked(self.states, key)
            return None
        kv = {n: torch.cat([p[n] for p in pages]) for n in pages[0]} if pages else {}
        kind = header.get("kind") or "long_anchor"
        if kind not in ("endpoint", "turn_closure", "long_anchor", "response_replay"):
            kind = "long_anchor"
        return cache_slots.SlotImage(dict(self.compat), list(prompt[:f]),
                                     [{"kind": kind, "frontier": f, "state": st}], kv)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
