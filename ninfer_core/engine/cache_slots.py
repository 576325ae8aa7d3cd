"""Slot files: a private continuation saved to disk and restored (spec "Slots").

File layout (little-endian):
    magic b"NINFSLOT" | u32 version | u64 header length | header JSON | tensor bytes | sha256 (32 B)
The header holds the compatibility facts, the session tokens, each checkpoint (kind, frontier and
its StateImage tensors) and a table of tensors (name, dtype, shape, offset, size) into the tensor
bytes: the KV pages of the deepest checkpoint (every shallower one is a prefix of it) and one
StateImage per checkpoint. The trailing checksum covers everything before it and is verified
before anything is parsed or allocated; files are written to a temporary name and renamed.

`collect_*` and `install_*` run on the engine worker (through `Engine.run_control`) and touch the
catalog; `encode`/`decode` and the file I/O run on a host thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from ninfer_core.engine.api import EngineError
from ninfer_core.engine.checkpoints import Checkpoint, Continuation, Entry, session_digest
from ninfer_core.engine.model_api import StateImage
from ninfer_core.engine.pages import pages_for

MAGIC = b"NINFSLOT"
VERSION = 1
_HEAD = struct.Struct("<8sIQ")
_SUM = 32
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_DEVICES = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                        torch.int64, torch.int32, torch.uint8, torch.int8)}


def slot_error(code: str, message: str, status: int = 400, param: str | None = None) -> EngineError:
    return EngineError(status, code, message, param=param)


def check_filename(name: Any) -> str:
    """The stored (lowercase) name, or 400 invalid_filename."""
    if not isinstance(name, str) or not _NAME.match(name) or name.startswith(".") or name.endswith("."):
        raise slot_error("invalid_filename", "filename must be 1-128 characters of [A-Za-z0-9._-] and may not "
                         "start or end with a dot", param="filename")
    if name.split(".")[0].lower() in _DEVICES:
        raise slot_error("invalid_filename", f"filename {name!r} is a reserved device name", param="filename")
    return name.lower()


@dataclass
class SlotImage:
    """A continuation's content outside the engine (what a slot file holds)."""

    compat: dict
    session: list[int]
    checkpoints: list[dict]  # {"kind", "frontier", "state": {name: tensor}}
    kv: dict[str, torch.Tensor]  # the deepest checkpoint's pages, [pages, ...] per tensor


# -- worker side ----------------------------------------------------------------------------------
def collect(cache, slot: int, if_digest: str | None, compat: dict) -> SlotImage:
    """Copy a retained continuation out of the engine (its pages' KV and every StateImage)."""
    cont = _continuation(cache, slot)
    if cont is None:
        raise slot_error("slot_save_failed", f"slot {slot} holds no session to save")
    _check_digest(cont, if_digest)
    return snapshot_continuation(cache, cont, compat)


def snapshot_continuation(cache, cont: Continuation, compat: dict) -> SlotImage:
    """A continuation's KV pages and StateImages as Host copies (slot files, the disk tier)."""
    kv = cache.kv_copy(cont.deepest())  # demoted to Host: the copy already is what a file holds
    ckpts = []
    for e in sorted(cont.entries, key=lambda e: e.ckpt.frontier):
        c = e.ckpt
        image = cache.state_copy(c)
        ckpts.append({"kind": e.kind, "frontier": c.frontier, "state": dict(image.tensors)})
    return SlotImage(dict(compat), list(cont.session), ckpts, kv)


def erase(cache, slot: int, if_digest: str | None) -> int:
    cont = _continuation(cache, slot)
    if cont is None:
        return 0
    _check_digest(cont, if_digest)
    n = len(cont.session)
    if cont.filename and cache.spiller is not None:  # an explicit erase never writes
        cache.spiller.supersede(cont.filename)
    cache._release_continuation(cont)
    return n


def bind_file(cache, slot: int, filename: str, depth: int, compat: dict) -> None:
    """After an explicit save: the slot's session is bound to the file (--auto-save-evicted spills
    it back there), at the depth the file now holds; waiting spills of the file are superseded.
    Call under the engine lock."""
    cont = cache.continuations[slot] if 0 <= slot < len(cache.continuations) else None
    if cont is not None:
        cont.filename, cont.file_depth = filename, depth
    if cache.spiller is not None:
        cache.spiller.compat = dict(compat)
        cache.spiller.supersede(filename)


def flush_spills(cache, filename: str, compat: dict) -> None:
    """Before a restore reads `filename`: write its waiting spills first (host thread)."""
    if cache.spiller is not None:
        cache.spiller.compat = dict(compat)
        cache.spiller.flush_file(filename)


def clear_slot(cache, slot: int) -> None:
    cont = _continuation(cache, slot)
    if cont is not None:
        cache._release_continuation(cont)


def install(cache, slot: int, image: SlotImage, filename: str, now: float) -> Continuation:
    """Replace the slot's content with a restored session; on any failure the slot is left empty
    and nothing stays allocated."""
    clear_slot(cache, slot)
    deepest = max(c["frontier"] for c in image.checkpoints)
    n_pages = pages_for(deepest, cache.page_size)
    if any(t.shape[0] != n_pages for t in image.kv.values()):
        raise slot_error("slot_restore_failed", "the slot file's KV pages do not cover its checkpoints")
    if not cache.pages.can_allocate(n_pages) and not cache.free_pages(n_pages - cache.pages.num_free):
        raise slot_error("slot_restore_failed", f"the KV pool has no room for {n_pages} pages", status=400)
    pages = cache.pages.allocate(n_pages)
    made: list[Checkpoint] = []
    try:
        cache.write_kv(pages, image.kv)
        for c in image.checkpoints:
            f = c["frontier"]
            ckpt = Checkpoint(tuple(image.session[:f]), [], last_used=now)
            ckpt.pages = cache.pages.share(pages[: pages_for(f, cache.page_size)])
            ckpt.refs = 1
            made.append(ckpt)
            state = StateImage(c["state"])
            _validate_image(cache, state)
            if not cache.install_state(ckpt, state, now):
                raise slot_error("slot_restore_failed", "no StateImage capacity for the restored session")
    except BaseException as exc:
        for ckpt in made:
            cache._drop(ckpt)
        cache.pages.free(pages)
        if isinstance(exc, EngineError):
            raise
        raise slot_error("slot_restore_failed", f"the slot file does not fit this model: {exc}") from None
    cache.pages.free(pages)  # the checkpoints hold their own references now
    entries = [Entry(c["kind"], ckpt) for c, ckpt in zip(image.checkpoints, made)]
    cont = Continuation(slot, tuple(image.session), entries, last_used=now, filename=filename,
                        file_depth=len(image.session) if filename else 0)
    cache.continuations[slot] = cont
    return cont


def _validate_image(cache, image: StateImage) -> None:
    """A Host image must have exactly the tensors (names, shapes, dtypes) of this model's state."""
    ref = cache.state_layout()
    got = image.tensors
    if set(ref) != set(got) or any(tuple(ref[k].shape) != tuple(got[k].shape) or ref[k].dtype != got[k].dtype
                                   for k in ref):
        raise ValueError("its StateImage does not have this model's state layout")


def _continuation(cache, slot: int) -> Continuation | None:
    if not 0 <= slot < len(cache.continuations):
        raise slot_error("invalid_slot", f"slot {slot} does not exist (0..{len(cache.continuations) - 1})",
                         param="id_slot")
    cont = cache.continuations[slot]
    if cont is not None and cont.busy:
        raise slot_error("slot_busy", f"slot {slot} is in use by a running request; retry", status=409)
    return cont


def _check_digest(cont: Continuation, if_digest: str | None) -> None:
    if if_digest is not None and if_digest.lower() != cont.digest:
        raise slot_error("slot_session_mismatch", "the slot no longer holds the session named by if_digest",
                         status=409, param="if_digest")


# -- host side: bytes ---------------------------------------------------------------------------
def tensor_blob(named: list[tuple[str, torch.Tensor]]) -> tuple[list[dict], bytes]:
    """The raw bytes of each tensor (on the host, contiguous) one after another, and the table that
    names each one's dtype, shape, offset and size; shared by slot files and disk-tier files."""
    table, blobs, off = [], [], 0
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        table.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "offset": off, "nbytes": len(raw)})
        blobs.append(raw)
        off += len(raw)
    return table, b"".join(blobs)


def encode(image: SlotImage) -> bytes:
    named = [(f"kv/{name}", t) for name, t in sorted(image.kv.items())]
    ckpts = []
    for i, c in enumerate(image.checkpoints):
        names = []
        for name, t in sorted(c["state"].items()):
            named.append((f"state/{i}/{name}", t))
            names.append(name)
        ckpts.append({"kind": c["kind"], "frontier": c["frontier"], "state": names})
    table, blob = tensor_blob(named)
    header = json.dumps({"compat": image.compat, "session": image.session, "checkpoints": ckpts,
                         "tensors": table}, separators=(",", ":")).encode()
    body = _HEAD.pack(MAGIC, VERSION, len(header)) + header + blob
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, compat: dict) -> SlotImage:
    """Verify the checksum first, then parse and check compatibility; 400 slot_restore_failed."""
    def bad(why: str) -> EngineError:
        return slot_error("slot_restore_failed", f"the slot file is {why}")

    if len(data) < _HEAD.size + _SUM:
        raise bad("truncated")
    body, tail = data[:-_SUM], data[-_SUM:]
    if hashlib.sha256(body).digest() != tail:
        raise bad("corrupt or truncated (checksum mismatch)")
    magic, version, hlen = _HEAD.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise bad(f"not a version {VERSION} NInfer slot file")
    try:
        header = json.loads(body[_HEAD.size: _HEAD.size + hlen])
        base = _HEAD.size + hlen
        tensors = {}
        for t in header["tensors"]:
            raw = body[base + t["offset"]: base + t["offset"] + t["nbytes"]]
            if len(raw) != t["nbytes"]:
                raise ValueError("tensor bytes out of range")
            dtype = _DTYPES[t["dtype"]]
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors[t["name"]] = buf.view(dtype).reshape(t["shape"])
        session = [int(x) for x in header["session"]]
        ckpts = []
        for i, c in enumerate(header["checkpoints"]):
            f = int(c["frontier"])
            if not 0 < f <= len(session) or c["kind"] not in ("endpoint", "turn_closure", "long_anchor",
                                                                "response_replay"):
                raise ValueError("bad checkpoint")
            ckpts.append({"kind": c["kind"], "frontier": f,
                          "state": {n: tensors[f"state/{i}/{n}"] for n in c["state"]}})
        if not ckpts:
            raise ValueError("no checkpoints")
        kv = {k[3:]: v for k, v in tensors.items() if k.startswith("kv/")}
        saved = header["compat"]
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, RuntimeError) as e:
        raise bad(f"malformed ({e})") from None
    diff = sorted(k for k in set(saved) | set(compat) if saved.get(k) != compat.get(k))
    if diff:
        raise slot_error("slot_restore_failed", "the slot file was saved by an incompatible server "
                         f"(differs in: {', '.join(diff)})")
    return SlotImage(saved, session, ckpts, kv)


def write_atomic(directory: str, name: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def digest_of(image: SlotImage) -> str:
    return session_digest(image.session)
