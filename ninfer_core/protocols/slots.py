"""Built-in protocol plugin: GET /slots and POST /slots/{id}?action=save|restore|erase (spec "Slots").

A slot is one private continuation cell of the checkpoint catalog. GET reads the engine's catalog
under its lock (never waits on a forward); save, restore and erase run on the engine worker at a
boundary (`Engine.run_control`), with the file I/O and checksum on a host thread. One slot
transaction runs at a time; another one meanwhile is 409 slot_busy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import anyio
from fastapi import APIRouter, Request

from ninfer_core import hookimpl
from ninfer_core.engine import cache_slots
from ninfer_core.engine.api import EngineError
from ninfer_core.server.context import ServerContext
from ninfer_core.server.json_body import parse_json_body

log = logging.getLogger("ninfer.server")
ACTIONS = ("save", "restore", "erase")


def compat_facts(ctx: ServerContext, engine: Any) -> dict:
    """What a slot file must share with this server to restore: artifact, formats, geometry."""
    m, spec = ctx.model, engine.cache_spec
    return {"artifact": os.path.basename(m.artifact_path or ""), "artifact_size": m.size,
            "architecture": m.architecture, "n_params": m.n_params, "n_vocab": m.n_vocab,
            "kv_dtype": ctx.options.engine.kv_dtype, "page_size": engine.page_size,
            "kv_bytes_per_token": spec.kv_bytes_per_token, "state_bytes": spec.state_bytes,
            "speculative": _spec_identity(engine)}


def _spec_identity(engine: Any) -> dict | None:
    """Backend, draft tokens and draft head: a slot file restores only under the same speculative setup."""
    backend = ((engine.snapshot() or {}).get("speculative") or {}).get("backend")
    if not backend:
        return None
    return {k: backend.get(k) for k in ("backend", "draft_tokens", "draft_head")}


class Slots:
    name = "slots"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        directory = ctx.options.engine.slot_save_path
        if directory:
            os.makedirs(directory, exist_ok=True)
        busy = asyncio.Lock()

        def catalog():
            eng = ctx.engine
            return eng, getattr(eng, "cache", None)

        async def list_slots() -> list:
            if ctx.options.no_slots:  # llama-server --no-slots: the listing only; actions stay
                raise EngineError(501, "slots_endpoint_disabled", "This server does not support the slots "
                                  "endpoint: it was started with --no-slots.", type_="not_supported_error")
            eng, cache = catalog()
            if cache is None:
                return []
            speculative = bool((eng.snapshot() or {}).get("speculative"))
            rows = eng.slots_report(ctx.options.engine.max_context)
            for row in rows:
                row["speculative"] = speculative
            return rows

        async def slot_action(id_slot: str, request: Request) -> dict:
            action = request.query_params.get("action")
            if action not in ACTIONS:
                raise EngineError(400, "invalid_action", f"action must be one of {', '.join(ACTIONS)}, "
                                  f"got {action!r}", param="action")
            if not directory:
                raise EngineError(501, "slot_persistence_disabled", "slot persistence is disabled: start the "
                                  "server with --slot-save-path DIR", type_="not_supported_error")
            eng, cache = catalog()
            try:
                slot = int(id_slot)
            except ValueError:
                slot = -1
            if cache is None or not 0 <= slot < len(cache.continuations):
                n = len(cache.continuations) if cache is not None else 0
                raise EngineError(400, "invalid_slot", f"slot {id_slot!r} does not exist (0..{n - 1})",
                                  param="id_slot")
            body = await _body(request)
            if_digest = body.get("if_digest")
            if if_digest is not None and not isinstance(if_digest, str):
                raise EngineError(400, "invalid_request", "if_digest must be a string", param="if_digest")
            if busy.locked():
                raise EngineError(409, "slot_busy", "another slot transaction is in progress; retry")
            async with busy:
                t0 = time.monotonic()
                if action == "erase":
                    n = await _worker(eng, lambda: cache_slots.erase(cache, slot, if_digest))
                    log.info("slot %d erased (%d tokens)", slot, n)
                    return {"id_slot": slot, "n_erased": n}
                name = cache_slots.check_filename(body.get("filename"))
                path = os.path.join(directory, name)
                compat = compat_facts(ctx, eng)
                if action == "save":
                    image = await _worker(eng, lambda: cache_slots.collect(cache, slot, if_digest, compat))
                    data = await anyio.to_thread.run_sync(cache_slots.encode, image)
                    try:
                        await anyio.to_thread.run_sync(cache_slots.write_atomic, directory, name, data)
                    except OSError as e:
                        raise EngineError(400, "slot_save_failed", f"writing {name} failed: {e.strerror}") from None
                    eng.bind_slot_file(slot, name, len(image.session), compat)  # for --auto-save-evicted
                    log.info("slot %d saved to %s (%d tokens, %d bytes)", slot, name, len(image.session), len(data))
                    return {"id_slot": slot, "filename": name, "n_saved": len(image.session),
                            "n_written": len(data), "session_digest": cache_slots.digest_of(image),
                            "timings": {"save_ms": (time.monotonic() - t0) * 1000.0}}
                try:
                    # Waiting auto-save spills of this file are written first: restore reads the newest.
                    await anyio.to_thread.run_sync(cache_slots.flush_spills, cache, name, compat)
                    data = await anyio.to_thread.run_sync(_read, path)
                    image = await anyio.to_thread.run_sync(cache_slots.decode, data, compat)
                    cont = await _worker(eng, lambda: cache_slots.install(cache, slot, image, name,
                                                                          time.monotonic()))
                except EngineError as e:
                    if e.code == "slot_restore_failed":  # a failed restore leaves the slot empty
                        await _worker(eng, lambda: cache_slots.clear_slot(cache, slot))
                    raise
                log.info("slot %d restored from %s (%d tokens)", slot, name, len(cont.session))
                return {"id_slot": slot, "filename": name, "n_restored": len(cont.session),
                        "n_read": len(data), "session_digest": cont.digest,
                        "timings": {"restore_ms": (time.monotonic() - t0) * 1000.0}}

        router.add_api_route("/slots", list_slots, methods=["GET"])
        router.add_api_route("/slots/{id_slot}", slot_action, methods=["POST"])


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise EngineError(400, "slot_restore_failed", f"no slot file named {os.path.basename(path)}",
                          param="filename") from None
    except OSError as e:
        raise EngineError(400, "slot_restore_failed", f"reading the slot file failed: {e.strerror}") from None


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise EngineError(400, "invalid_request", "the request body must be a JSON object")
    return body


async def _worker(eng, fn):
    return await asyncio.wrap_future(eng.run_control(fn))


PROTOCOL = Slots()


@hookimpl
def ninfer_register_protocols(register):
    register("slots", "ninfer_core.protocols.slots:PROTOCOL")
