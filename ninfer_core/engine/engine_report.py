"""What the engine reports: the GET /stats snapshot and the finish event of a request.

Owns the engine's counter names (COUNTERS, UNIT_COUNTERS), the snapshot the server's /stats,
/metrics and /slots read (`snapshot`, taken under the engine lock), and the finish event with its
per-request log lines (`finish_event`: usage, timings, the context-cache report, the
speculative and thinking facts). Counts and rates only: no log line here carries prompt or
output text.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ninfer_core.engine.api import EngineEvent, Usage
from ninfer_core.engine.media_side import overlay_log_text, vision_overlay_report

if TYPE_CHECKING:
    from ninfer_core.engine.engine import Engine
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine")

COUNTERS = ("requests_completed", "requests_cancelled", "requests_rejected", "requests_timed_out",
            "requests_failed", "prompt_tokens_total", "generated_tokens_total")
# Per-unit execution totals for GET /metrics and /v1/load (spec "Metrics"): they advance with every
# prefill chunk and decode round, whichever request it served, not at request completion.
UNIT_COUNTERS = ("computed_prefill_tokens", "prefill_seconds", "decode_seconds", "decode_rounds",
                 "decode_row_rounds", "committed_decode_tokens", "prefix_cache_hit_tokens",
                 "waiting_cancelled", "waiting_expired", "waiting_abandoned_seconds", "cancelled_prefills",
                 "cancelled_prefill_computed_tokens", "context_transfer_seconds",
                 # worker iterations that failed outside any one forward and were survived (spec
                 # ninfer:engine_recoveries_total): the affected requests fail, the worker goes on
                 "engine_recoveries",
                 # speculative decoding, counted when a request completes (spec ninfer:draft_*_total;
                 # llama.cpp's spec_decode_num_* series): drafted / accepted tokens, rounds with drafts
                 "draft_tokens", "draft_accepted_tokens", "draft_rounds")


def snapshot(eng: Engine) -> dict[str, Any]:
    """`Engine.snapshot`: counters and pool occupancy, read under the engine's lock."""
    with eng._cv:
        s = eng.scheduler
        return {
            "lanes_active": len(s.lanes),
            "lanes_total": s.max_lanes,
            "prefilling": len(s.staged()),
            "decode_ready": len(s.decode_batch()),
            "pages_total": s.pages.num_pages,
            "pages_free": s.pages.num_free,
            "page_size": eng.page_size,
            "slots_total": s.slots.num_slots,
            "slots_free": s.slots.num_free,
            "pending": len(s.waiting),
            # GET /stats: the first 16 waiting requests in submission order.
            "queue": [{"request_id": q.request_id, "position": i, "wait_seconds": time.monotonic() - q.t_submit}
                      for i, q in zip(range(16), s.waiting)],
            "outstanding": eng._outstanding,
            "capacity": eng.capacity,
            "kv_bytes": eng.kv_bytes,
            "state_bytes": eng.state_bytes,
            "counters": dict(eng.counters),
            # llama.cpp's n_tokens_max, and the pages running requests hold (the gateway's KV usage)
            "n_tokens_max": max([eng._n_tokens_max] + [lane_tokens(q) for q in s.lanes]),
            "pages_in_lanes": len({p for q in s.lanes for p in q.pages}),
            "context_cache": eng.cache.snapshot() if eng.cache is not None else None,
            "speculative": eng.rounds.describe(),
            "vision": dict(eng.vision_counters, residency=eng.vision.name) if eng.vision is not None else None,
            "failed": eng.recovery.failure,
            # the family's own counter blocks (GET /stats shows each under its name)
            "model": _model_counters(eng),
        }


def _model_counters(eng: Engine) -> dict[str, Any]:
    try:
        return dict(eng.runner.counters() or {})
    except Exception:  # noqa: BLE001 - a stats probe must answer even if a family's report fails
        return {}


def finish_event(eng: Engine, seq: Sequence, reason: str, stop_reason: str | None) -> EngineEvent:
    """A request's finish (or cancel) event, logging its completion lines."""
    usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids),
                  cached_tokens=seq.cache_n)
    t = seq.timings() or {}
    # Counts and rates only: a log line never carries prompt or output text.
    # The completion line names the reuse path (spec: root, private_endpoint, ...) and cache=.
    mat = getattr(seq, "cache_materialization", None)
    log.info("request %s %s (%s): prompt %d tokens, cache=%d via %s, in %.0f ms, %d output tokens at %.1f tok/s%s%s",
             seq.request_id, reason, stop_reason or "-", seq.prompt_len, t.get("cache_n", 0) or 0,
             getattr(seq, "cache_source", None) or "root", t.get("prompt_ms", 0.0) or 0.0,
             len(seq.output_ids), t.get("predicted_per_second", 0.0) or 0.0,
             # the admission's materialization decision, when it had to make room
             "" if not mat or mat["stop_reason"] == "no_pressure" else
             f" (best reuse {mat['best_reuse_prompt_tokens']}, degraded {mat['degradation_tokens']}, "
             f"search {mat['stop_reason']}{', maximal fallback' if mat['maximal_fallback'] else ''})",
             overlay_log_text(vision_overlay_report(getattr(seq, "vision_windows", None))))
    spec = getattr(seq, "spec_facts", None) or eng.rounds.facts(seq)
    if spec is not None and (spec["rounds"] or spec["fallback_steps"]):
        rate = spec["accepted_tokens"] / spec["drafted_tokens"] if spec["drafted_tokens"] else 0.0
        log.info("request %s drafts: %d/%d accepted (%.2f) in %d rounds, %.2f accepted per drafted round, "
                 "n-gram %d/%d in %d rounds, %d rounds without drafts", seq.request_id,
                 spec["accepted_tokens"], spec["drafted_tokens"], rate, spec["rounds"],
                 spec["accepted_tokens"] / spec["rounds"] if spec["rounds"] else 0.0,
                 spec["ngram_accepted_tokens"], spec["ngram_drafted_tokens"], spec["ngram_rounds"],
                 spec["fallback_steps"])
    facts = seq.thinking.facts() if seq.thinking is not None else None
    if facts is not None:  # the requested budget, and the effective one when it differs
        budget = facts["budget_requested"]
        if budget is not None and facts["budget_effective"] not in (None, budget):
            budget = f"{budget} (effective {facts['budget_effective']})"
        log.info("request %s thinking: budget %s, early close %s, %d reasoning tokens, post-thinking "
                 "sampling %s", seq.request_id, budget, facts["early_close"], facts["reasoning_tokens"],
                 facts["post_thinking_sampling"])
    return EngineEvent("finish", finish_reason=reason, stop_reason=stop_reason, usage=usage,
                       timings=seq.timings(), matched_stop=seq.output.matched_stop,
                       scores=getattr(seq, "scores", None),
                       thinking=seq.thinking.facts() if seq.thinking is not None else None,
                       context=context_report(seq), speculative=spec)


def context_report(seq: Sequence) -> dict | None:
    """The finish event's context-cache facts: the reuse path, and the /slots cell and session
    digest a completed session was retained under."""
    source = getattr(seq, "cache_source", None)
    overlay = vision_overlay_report(getattr(seq, "vision_windows", None))
    if source is None:
        return {"vision_overlay": overlay} if overlay else None
    cont = getattr(seq, "retained", None)
    report: dict = {"source": source, "cache_n": seq.cache_n}
    if overlay:
        report["vision_overlay"] = overlay
    mat = getattr(seq, "cache_materialization", None)
    if mat is not None:  # the admission's context-cache decision (spec request_done.materialization)
        report["materialization"] = dict(mat)
    if cont is not None:
        report.update(id_slot=cont.slot, session_digest=cont.digest)
    return report


def lane_tokens(seq: Sequence) -> int:
    """Tokens a lane's sequence holds: the prompt processed so far, then prompt and output."""
    return max(seq.num_cached, seq.prompt_len + len(seq.output_ids) if seq.output_ids else 0)
