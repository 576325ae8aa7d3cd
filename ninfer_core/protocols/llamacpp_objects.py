"""llama.cpp's /completion result objects, shared by /completion and the `__verbose` extension.

llama-server adds `__verbose` to OpenAI-shaped results (/v1/chat/completions, /v1/completions):
the same request's result in /completion's own shape (server-task.cpp, `to_json_non_oaicompat`),
the final object on the final response (a stream: on the first chunk of the final group, the
finish chunk) and the partial object on /v1/completions' streamed chunks. llama-server emits it
when it runs with verbose logging; NInfer when the request sets `verbose: true`, since it only
repeats what the caller sent and received.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.api import EngineEvent

# A request the context cache did not retain (cache_prompt false, --no-prefix-reuse) is in no slot:
# -1 is llama.cpp's "any slot", which a client echoing it back as id_slot leaves without effect.
NO_SLOT = -1
STOP_TYPES = {"eos": "eos", "stop_string": "word", "max_tokens": "limit", "context": "limit"}


def retained_slot(ev: EngineEvent) -> int:
    """The /slots cell the finished session was retained under (the context cache's report)."""
    slot = (getattr(ev, "context", None) or {}).get("id_slot")
    return slot if isinstance(slot, int) else NO_SLOT


def final_object(ctx: Any, ev: EngineEvent, *, index: int, content: str, ids: list[int], return_tokens: bool,
                 prompt_ids: list[int], settings: dict) -> dict:
    """The finished request as /completion answers it (`settings` is its generation_settings)."""
    u = ev.usage
    stop_type = STOP_TYPES.get(ev.stop_reason or "", "none")
    return {
        "index": index, "content": content, "tokens": list(ids) if return_tokens else [],
        "id_slot": retained_slot(ev), "stop": True, "model": ctx.model.id,
        "tokens_predicted": u.completion_tokens if u else len(ids),
        "tokens_evaluated": u.prompt_tokens if u else len(prompt_ids),
        "generation_settings": settings,
        "prompt": ctx.tokenizer.decode(prompt_ids, skip_special=False), "has_new_line": "\n" in content,
        "truncated": False, "stop_type": stop_type,
        "stopping_word": (ev.matched_stop or "") if stop_type == "word" else "",
        "tokens_cached": u.cached_tokens if u else 0, "timings": ev.timings or {},
    }


def partial_object(*, index: int, content: str, tokens_predicted: int, tokens_evaluated: int) -> dict:
    """One streamed piece as /completion streams it."""
    return {"index": index, "content": content, "tokens": [], "stop": False, "id_slot": NO_SLOT,
            "tokens_predicted": tokens_predicted, "tokens_evaluated": tokens_evaluated}


class VerboseRecord:
    """What `__verbose` reports for one OpenAI-shaped result: the generated text and ids as they
    arrive, then the final object (a stream's has an empty content, as llama.cpp's does)."""

    def __init__(self, ctx: Any, prompt_ids: list[int], settings: dict, index: int = 0):
        self.ctx, self.prompt_ids, self.settings, self.index = ctx, prompt_ids, settings, index
        self.texts: list[str] = []
        self.ids: list[int] = []

    def feed(self, ev: EngineEvent) -> None:
        self.texts.append(ev.text)
        self.ids.extend(ev.token_ids)

    def final(self, ev: EngineEvent, streamed: bool = False) -> dict:
        return final_object(self.ctx, ev, index=self.index, content="" if streamed else "".join(self.texts),
                            ids=self.ids, return_tokens=False, prompt_ids=self.prompt_ids, settings=self.settings)
