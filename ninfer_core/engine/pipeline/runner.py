"""PipelineRunner: the ordinary ModelRunner contract over a model split into pipeline stages.

The engine and the context cache see one runner. Stage 0 (the embeddings and the first layers)
runs in the engine's process on the first device; each further stage is a spawned process on its
own device (ninfer_core.engine.pipeline.stage). Every stage holds its layers' KV for the engine's
whole page-id space and its layers' state in every slot, so page and slot ids mean the same on
every stage: a cache op is the same op on each stage, a StateImage is the union of the stages'
images (their tensor names are keyed by model layer, so they never clash) and restoring one hands
each stage its own tensors back. A forward is cut into micro-batches (microbatch.py) that follow
each other through the stages; the last stage sends the logits to rank 0, where the engine samples.
A decode or verify round of several lanes is cut into one lane group per stage (`round_groups`),
so that every lane's round is pipelined; `counters()["pipeline"]` says how the stages overlapped.

A stage process that fails or ends stops the pipeline: the forward that saw it raises, and so does
every later call (the engine then fails as it does on any broken invariant).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ninfer_core.engine.model_api import (
    PAGE_SIZE,
    CacheSpec,
    ForwardBatch,
    ModelRunner,
    RunnerOptions,
    SegmentOutput,
    StateImage,
    check_batch,
)
from ninfer_core.engine.pipeline import microbatch
from ninfer_core.engine.pipeline.overlap import OverlapCounters
from ninfer_core.engine.pipeline.split import free_memory, plan_stages
from ninfer_core.engine.pipeline.stage import (
    StageSpec,
    asked_layers,
    init_groups,
    load_target,
    names_of,
    stage_forward,
)

log = logging.getLogger("ninfer.pipeline")

MICROBATCH_TOKENS = 256  # fewest tokens per micro-batch (below it a stage is memory bound: no cut)
_ERRORS = {"ValueError": ValueError, "RuntimeError": RuntimeError, "NotImplementedError": NotImplementedError}


class PipelineError(RuntimeError):
    """A stage process failed or ended; the pipeline is stopped."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def family_target(target: Any) -> str:
    """A family registration's target as the "module:Class" a spawned process imports."""
    if isinstance(target, str):
        return target
    cls = target if isinstance(target, type) else type(target)
    return f"{cls.__module__}:{cls.__qualname__}"


class PipelineRunner(ModelRunner):
    """Built by `start`; `close` ends the stage processes (also at interpreter exit)."""

    def __init__(self, stage0, workers: list, groups, ranges: list[range], devices: list[str], specs: list[CacheSpec],
                 infos: list, microbatch_tokens: int = MICROBATCH_TOKENS):
        self.stage0, self.workers, self.groups = stage0, workers, groups  # workers: [(process, conn)]
        self.ranges, self.devices, self.microbatch_tokens = ranges, devices, microbatch_tokens
        self.round_groups = len(ranges)  # lane groups of a decode / verify round (1: whole rounds)
        self.overlap = OverlapCounters(len(ranges))
        self.device = stage0.device
        self.stage_specs = specs
        self._spec = merge_cache_specs(specs)
        first = infos[0]
        self.info = replace(first, n_params=sum(int(i.n_params) for i in infos),
                            extra=dict(first.extra, pipeline={"devices": list(devices),
                                                              "stage_layers": [len(r) for r in ranges]}))
        self.num_pages = self.num_slots = 0
        self.page_size = PAGE_SIZE
        self._names: list[tuple[list[str], list[str]]] = []  # per stage: (state names, page names)
        self._broken: str | None = None
        self._closed = False

    # ---- building and ending ------------------------------------------------------------------
    @classmethod
    def start(cls, family: Any, artifact_path: Any, devices: list[str], stage_layers: list[int] | None = None,
              dtype: str | None = None, options: Any = None, microbatch_tokens: int = MICROBATCH_TOKENS,
              timeout_s: float = 1800.0) -> PipelineRunner:
        """Split the family's layers over `devices` (`stage_layers`, else by free memory), spawn one
        process per stage after the first and load every stage; raises ValueError for a split
        the model refuses, PipelineError when a stage fails to load. `artifact_path` may also be a
        picklable factory(device) -> artifact (random weights drawn on each stage's device)."""
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from ninfer_core.engine.pipeline.split import StageSplitError
        from ninfer_core.engine.pipeline.stage import open_artifact

        target = family_target(family)
        fam = load_target(target) if isinstance(family, str) else (family() if isinstance(family, type) else family)
        art = open_artifact(artifact_path, devices[0])
        n = int(fam.pipeline_layers(art) or 0)
        if n <= 0:
            raise StageSplitError(f"--devices: the {getattr(fam, 'name', '') or type(fam).__name__} family cannot run "
                                  "as pipeline stages")
        cuts = getattr(fam, "pipeline_cuts", lambda _a: None)(art)
        ranges = plan_stages(n, devices, stage_layers, free_memory(devices), cuts)
        if dist.is_initialized():
            raise PipelineError("this process already holds a torch.distributed group (one pipeline per process)")
        backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the stages are processes of this machine
        else:
            os.environ["NCCL_NVLS_ENABLE"] = "0"
        init = f"tcp://127.0.0.1:{_free_port()}"
        specs = [StageSpec(rank=k, world=len(devices), init_method=init, backend=backend, family_target=target,
                           artifact_path=artifact_path, device=devices[k], layers=(r.start, r.stop), dtype=dtype,
                           options=options, timeout_s=timeout_s) for k, r in enumerate(ranges)]
        ctx = mp.get_context("spawn")
        workers = []
        from ninfer_core.engine.pipeline.stage import stage_main

        try:
            for spec in specs[1:]:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=stage_main, args=(spec, child), name=f"ninfer-stage-{spec.rank}", daemon=True)
                proc.start()
                child.close()
                workers.append((proc, parent))
            groups = init_groups(specs[0])
            from ninfer_core.engine.pipeline.stage import load_stage

            stage0 = load_stage(specs[0])
            infos, cache_specs = [stage0.info], [stage0.cache_spec()]
            for k, (proc, conn) in enumerate(workers, 1):
                ready = _reply(proc, conn, k, devices[k])
                infos.append(ready["info"])
                cache_specs.append(ready["cache_spec"])
        except BaseException:
            _end(workers)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        log.info("pipeline of %d stages (%s): layers %s", len(devices), backend,
                 ", ".join(f"{d} {r.start}..{r.stop - 1}" for d, r in zip(devices, ranges)))
        runner = cls(stage0, workers, groups, ranges, devices, cache_specs, infos, microbatch_tokens)
        import atexit

        atexit.register(runner.close)
        return runner

    def close(self) -> None:
        """End the stage processes and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _, conn in self.workers:
            try:
                conn.send(("exit", None))
            except Exception:  # noqa: BLE001 - already gone
                pass
        _end(self.workers, grace_s=10.0)
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass

    # ---- talking to the stages ------------------------------------------------------------------
    def _live(self) -> None:
        if self._closed:
            raise PipelineError("the pipeline is closed")
        if self._broken:
            raise PipelineError(f"the pipeline is stopped: {self._broken}")

    def _each(self, op: str, args_per_stage: list[tuple]) -> list:
        """Run `op` on every stage (workers first, so they run while stage 0 does); their results."""
        self._live()
        try:
            for (_, conn), args in zip(self.workers, args_per_stage[1:]):
                conn.send((op, args))
            if op == "names":
                first = names_of(self.stage0)
            else:
                first = getattr(self.stage0, op)(*args_per_stage[0])
        except BaseException:
            self._collect_quietly()
            raise
        return [first, *self._collect()]

    def _all(self, op: str, *args) -> list:
        return self._each(op, [args] * (1 + len(self.workers)))

    def _collect(self) -> list:
        out, error = [], None
        for k, (proc, conn) in enumerate(self.workers, 1):
            try:
                out.append(_reply(proc, conn, k, self.devices[k]))
            except PipelineError as e:
                self._stop(str(e))
                error = error or e
            except (ValueError, RuntimeError, NotImplementedError) as e:
                error = error or e
        if error is not None:
            raise error
        return out

    def _collect_quietly(self) -> None:
        try:
            self._collect()
        except Exception:  # noqa: BLE001 - the first error is the one raised
            pass

    def _stop(self, reason: str) -> None:
        if not self._broken:
            self._broken = reason
            log.error("pipeline stopped: %s", reason)
            _end(self.workers)

    # ---- cache --------------------------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        return self._spec

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        self._all("allocate_cache", num_pages, num_slots, page_size)
        self.num_pages, self.num_slots, self.page_size = num_pages, num_slots, page_size
        self._names = self._all("names")

    def free_cache(self) -> None:
        self._all("free_cache")
        self.num_pages = self.num_slots = 0

    def configure(self, options: RunnerOptions) -> None:
        self._all("configure", options)
        # a stage's cache geometry may follow the options (a sliding-window ring sized by the chunk)
        self.stage_specs = self._all("cache_spec")
        self._spec = merge_cache_specs(self.stage_specs)

    def reset_slot(self, slot: int) -> None:
        self._all("reset_slot", slot)

    def copy_slot(self, src: int, dst: int) -> None:
        self._all("copy_slot", src, dst)

    def copy_page(self, src: int, dst: int) -> None:
        self._all("copy_page", src, dst)

    def capture_state(self, slot: int) -> StateImage:
        tensors: dict = {}
        for image in self._all("capture_state", slot):
            tensors.update(image.tensors)
        return StateImage(tensors)

    def restore_state(self, image: StateImage, slot: int) -> None:
        owned = {n for names, _ in self._names for n in names}
        if set(image.tensors) - owned:
            raise ValueError("StateImage holds state this model does not keep (another speculative setup?)")
        self._each("restore_state", [(StateImage({n: image.tensors[n] for n in names if n in image.tensors}), slot)
                                     for names, _ in self._names])

    def read_pages(self, pages: Sequence[int]) -> dict[str, Any]:
        out: dict = {}
        for part in self._all("read_pages", list(pages)):
            out.update(part)
        return out

    def write_pages(self, pages: Sequence[int], data: dict[str, Any]) -> None:
        owned = {n for _, names in self._names for n in names}
        if set(data) != owned:
            raise ValueError("KV data does not fit this model's pages (another model or speculative setup)")
        self._each("write_pages", [(list(pages), {n: data[n] for n in names}) for _, names in self._names])

    # ---- forwards -----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        self._live()
        check_batch(batch, self.info.vocab_size, self.num_slots, self.num_pages, self._spec.group_names,
                    self.page_size)
        pieces, how = microbatch.plan(batch, len(self.ranges), self.microbatch_tokens, self.round_groups)
        hidden_size = int(self.info.hidden_size)
        vocab = int(self.info.vocab_size)
        stripped = [ForwardBatch([_without_media(s, vocab) for s in p.segments]) for p in pieces]
        try:
            for _, conn in self.workers:
                conn.send(("forward", (stripped, hidden_size)))
        except OSError as e:
            self._stop(f"a stage's pipe is closed ({e})")
            raise PipelineError(self._broken) from e
        error, first, taps = None, None, [{} for _ in pieces]
        try:
            first, taps = stage_forward(self.stage0, pieces, 0, len(self.ranges), self.groups, hidden_size,
                                        self.ranges[0])
        except Exception as e:  # noqa: BLE001 - every stage still ends this forward
            error = e
        try:
            outputs = self._receive(pieces, hidden_size, taps)
        except BaseException as e:
            self._stop(f"receiving the last stage's outputs failed: {type(e).__name__}: {e}")
            raise PipelineError(self._broken) from e
        spans = self._collect()
        if error is not None:
            raise error
        got = self.overlap.add([first, *spans], how, how == "lanes")
        if len(pieces) > 1:
            log.debug("forward cut %s into %d pieces over %d stages: %d overlapped", how, len(pieces),
                      len(self.ranges), got)
        return microbatch.join(batch, how, outputs)

    def counters(self) -> dict:
        """{"pipeline": the stages' overlap counters (ninfer_core.engine.pipeline.overlap)}."""
        return {"pipeline": self.overlap.as_dict()}

    def _receive(self, pieces: list[ForwardBatch], hidden_size: int, taps: list[dict]) -> list[list[SegmentOutput]]:
        """Post the receives of every stage's asked layer outputs and the last stage's outputs for
        every piece (in the order the stages send them), wait for them, and cut them into
        SegmentOutputs. `taps`: stage 0's own layer outputs per piece (filled in here)."""
        import torch
        import torch.distributed as dist

        from ninfer_core.engine.model_api import FINAL_HIDDEN

        last, ret = len(self.ranges) - 1, self.groups[1]
        dtype = self.stage0.dtype
        posted = []
        for p, layer_out in zip(pieces, taps):
            rows = [microbatch.output_rows(s) for s in p.segments]
            n_logits, n_hidden = sum(r[0] for r in rows), sum(r[1] for r in rows)
            logits = hidden = None
            works = []
            n_rows = sum(len(s) for s in p.segments)
            for k in range(1, last + 1):
                for layer in asked_layers(p, self.ranges[k]):
                    layer_out[layer] = torch.empty(n_rows, hidden_size, dtype=dtype, device=self.device)
                    works.append(dist.irecv(layer_out[layer], src=k, group=ret))
            if n_logits:
                logits = torch.empty(n_logits, int(self.info.vocab_size), dtype=torch.float32, device=self.device)
                works.append(dist.irecv(logits, src=last, group=ret))
            if n_hidden:
                hidden = torch.empty(n_hidden, hidden_size, dtype=self.stage0.dtype, device=self.device)
                works.append(dist.irecv(hidden, src=last, group=ret))
            posted.append((p, rows, logits, hidden, works))
        for *_, works in posted:
            for w in works:
                self._wait(w)
        out = []
        for (p, rows, logits, hidden, _), layer_out in zip(posted, taps):
            li = hi = off = 0
            outs = []
            for s, (nl, nh) in zip(p.segments, rows):
                lg = None
                if nl:
                    lg = logits[li] if s.logits == "last" else logits[li: li + nl]
                got = {layer: layer_out[layer][off: off + len(s)] for layer in s.hidden if layer in layer_out}
                if nh:
                    got[FINAL_HIDDEN] = hidden[hi: hi + nh]
                outs.append(SegmentOutput(lg, got))
                li, hi, off = li + nl, hi + nh, off + len(s)
            out.append(outs)
        return out

    def _wait(self, work) -> None:
        """Wait for one receive (a stage that fails still sends zeros, so it completes; a stage
        process that ends makes gloo's receive raise)."""
        work.wait()

    def commit(self, kept: Sequence[tuple[int, int]]) -> None:
        self._all("commit", [(int(a), int(b)) for a, b in kept])

    def embed(self, token_ids):
        return self.stage0.embed(token_ids)

    # ---- speculative decoding: the draft and LM heads on the last stage (pipeline.draft) ---------
    def on_last(self, op: str, *args):
        """Run one op on the last stage's process and return its answer."""
        self._live()
        proc, conn = self.workers[-1]
        try:
            conn.send((op, args))
        except OSError as e:
            self._stop(f"a stage's pipe is closed ({e})")
            raise PipelineError(self._broken) from e
        try:
            return _reply(proc, conn, len(self.workers), self.devices[-1])
        except PipelineError as e:
            self._stop(str(e))
            raise

    def logits(self, hidden):
        """fp32 logits of final-normed hidden states through the last stage's LM head."""
        from ninfer_core.engine.pipeline.draft import host

        return self.on_last("logits", host(hidden)).to(self.device)

    def draft_heads(self) -> tuple[str, ...]:
        return tuple(self.on_last("draft_heads"))

    def enable_draft_head(self, name: str):
        """The last stage's draft head (before allocate_cache): its KV group joins the cache spec."""
        from ninfer_core.engine.pipeline.draft import StageDraftHead

        if self.num_pages:
            raise RuntimeError("enable the draft head before allocate_cache")
        head = self.on_last("enable_draft_head", name)
        self.stage_specs = self._all("cache_spec")
        self._spec = merge_cache_specs(self.stage_specs)
        return StageDraftHead(self, *head)

    @property
    def dtype(self):
        return self.stage0.dtype


def merge_cache_specs(specs: list[CacheSpec]) -> CacheSpec:
    """One CacheSpec of the whole model from the stages': groups of one name join their layers."""
    groups: dict[str, Any] = {}
    for sp in specs:
        for g in sp.kv_groups:
            old = groups.get(g.name)
            if old is None:
                groups[g.name] = g
                continue
            if (old.kv_heads, old.head_dim, old.window, old.page_size) != (g.kv_heads, g.head_dim, g.window,
                                                                           g.page_size):
                raise ValueError(f"KV group {g.name!r} has another geometry on another stage")
            groups[g.name] = replace(old, layers=old.layers + g.layers,
                                     bytes_per_token=old.bytes_per_token + g.bytes_per_token)
    return CacheSpec(kv_groups=tuple(groups.values()), state_bytes=sum(s.state_bytes for s in specs),
                     state_layers=tuple(i for s in specs for i in s.state_layers))


def _without_media(seg, vocab_size: int):
    """Spliced media embeddings only matter to the first stage (positions go to every stage). The
    media rows' identity ids become the last vocabulary id, the id a whole model clamps them to
    where it reads them besides the embedding (a draft head's ride-along)."""
    if seg.side is None or not seg.side.embeddings:
        return seg
    covered = seg.side.covered_rows()
    tokens = [min(int(t), vocab_size - 1) if i in covered else t for i, t in enumerate(seg.tokens)]
    return replace(seg, tokens=tokens, side=replace(seg.side, embeddings=[]))


def _reply(proc, conn, rank: int, device: str, poll_s: float = 0.5):
    """The next answer of a worker stage: its result, or its error raised here."""
    while not conn.poll(poll_s):
        if not proc.is_alive():
            raise PipelineError(f"stage {rank} ({device}) ended with exit code {proc.exitcode}")
    try:
        msg = conn.recv()
    except (EOFError, OSError) as e:
        raise PipelineError(f"stage {rank} ({device}) closed its pipe ({e})") from e
    return _answer(msg, rank, device)


def _answer(msg: tuple, rank: int, device: str):
    if msg[0] == "ok":
        return msg[1]
    _, kind, text, trace = msg
    if kind in _ERRORS:
        raise _ERRORS[kind](text)
    log.debug("stage %d traceback:\n%s", rank, trace)
    raise PipelineError(f"stage {rank} ({device}) failed: {kind}: {text}")


def _end(workers: list, grace_s: float = 2.0) -> None:
    """Join the worker processes this runner started; terminate those that do not end in time."""
    deadline = time.monotonic() + grace_s
    for proc, _ in workers:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc, _ in workers:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
