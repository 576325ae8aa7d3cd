"""preserve_thinking capture rules on a real server (tiny Qwen3.5, httpx), through a tool loop.

The template keeps the reasoning of the assistant turns after the last user query (the open turn)
and drops it once a new user message closes that turn, unless preserve_thinking is true. So:

* preserve false: each loop step resumes at the previous step's opener (the rolling closure), and
  the request that closes the turn resumes at the first assistant opener after the last user query,
  the turn closure every step of the loop kept, however long the loop ran;
* preserve true: nothing is re-rendered differently, so the closing request resumes at the last
  step's opener.

In both cases the greedy answer equals the same prompt served from root.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(600)

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent. Read files before answering."}
STEPS = 4  # more loop steps than a continuation keeps checkpoints (2 + 2 long anchors)


def chat(base: str, messages: list[dict], preserve: bool) -> dict:
    body = {"model": "", "messages": messages, "tools": TOOLS, "max_tokens": 6, "temperature": 0,
            "preserve_thinking": preserve}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def prologue_tokens(base: str) -> int:
    """Tokens of the generation prologue the template appends (assistant opener + open think block)."""
    r = httpx.post(base + "/tokenize", json={"content": "<|im_start|>assistant\n<think>\n"}, timeout=30)
    return len(r.json()["tokens"])


def loop_step(i: int) -> list[dict]:
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{i}.py"})}}
    return [{"role": "assistant", "content": "", "reasoning_content": f"I should read module {i} first.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f{i}():\n    return {i}\n"}]


def run_session(base: str, preserve: bool) -> tuple[list[dict], list[list[dict]]]:
    msgs = [SYSTEM, {"role": "user", "content": "What do the modules return?"}]
    prompts, replies = [list(msgs)], [chat(base, msgs, preserve)]
    for i in range(STEPS):
        msgs += loop_step(i)
        prompts.append(list(msgs))
        replies.append(chat(base, msgs, preserve))
    msgs += [{"role": "assistant", "content": "They return their index.",
              "reasoning_content": "All four modules were read."},
             {"role": "user", "content": "Thanks. Which one returns 2?"}]
    prompts.append(list(msgs))
    replies.append(chat(base, msgs, preserve))
    return replies, prompts


@pytest.mark.parametrize("preserve", [False, True])
def test_tool_loop_and_closing_turn_resume_where_the_template_keeps_tokens(start_server, preserve):
    cache = start_server("--max-private-continuations", "2")
    root = start_server("--no-prefix-reuse")
    replies, prompts = run_session(cache.base_url, preserve)
    p = prologue_tokens(cache.base_url)
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in replies]
    cache_n = [r["timings"]["cache_n"] for r in replies]
    assert cache_n[0] == 0
    # Every loop step resumes at the previous step's opener: all of the previous prompt but its prologue.
    for k in range(1, STEPS + 1):
        assert cache_n[k] == prompt_tokens[k - 1] - p, (k, cache_n, prompt_tokens)
    closing = cache_n[-1]
    if preserve:
        assert closing == prompt_tokens[STEPS] - p  # the history renders as it ran
    else:
        # The first assistant opener after the last user query: the first request's prologue start.
        assert closing == prompt_tokens[0] - p
    assert replies[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == closing
    # Exactness: the closing turn served from root gives the same greedy output.
    cold = chat(root.base_url, prompts[-1], preserve)
    assert cold["timings"]["cache_n"] == 0 and cold["usage"]["prompt_tokens"] == prompt_tokens[-1]
    assert cold["choices"][0]["message"] == replies[-1]["choices"][0]["message"]
    assert f"source=private_turn_closure cache={closing}" in cache.log()
