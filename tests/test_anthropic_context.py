"""Anthropic context editing (`context_management`): the edits, what they change in the rendered
prompt, what the response reports, and the 400s for edits this server cannot honour.

Over TestClient and the FakeEngine (it records the submitted prompt); the real server and the
`anthropic` client's beta API are in tests/e2e/test_e2e_anthropic_context.py.
"""

from __future__ import annotations

import json

import pytest

from ninfer_core.protocols.anthropic_context import TOOL_RESULT_PLACEHOLDER

from test_anthropic import PROTOCOLS, check_error, prompt_text

TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
GREP = {"name": "grep", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
# Claude Code 2.1.197 sends exactly this with every request (and the context-management beta header).
CLAUDE_CODE_EDIT = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}


@pytest.fixture
def client(make_app):
    c, ctx, engine = make_app(builtins=PROTOCOLS, preserve_thinking=True)
    c.ctx, c.engine = ctx, engine
    return c


def tool_loop(n: int, tool=TOOL, thinking: bool = True) -> list[dict]:
    """A user question, then `n` rounds of an assistant tool_use (with thinking) and its result."""
    msgs = [{"role": "user", "content": "Summarise the files."}]
    for i in range(n):
        content = [{"type": "thinking", "thinking": f"I should read file {i}.", "signature": "sig"}] if thinking else []
        content.append({"type": "tool_use", "id": f"toolu_{i}", "name": tool["name"], "input": {"path": f"f{i}.txt"}})
        msgs.append({"role": "assistant", "content": content})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                  "content": f"contents of file number {i} " * 20}]})
    return msgs


def send(client, messages, cm=None, path="/v1/messages", tools=(TOOL,), **extra):
    body = {"model": "claude-opus-4-8", "max_tokens": 64, "messages": messages, "tools": list(tools),
            "thinking": {"type": "adaptive"}, **extra}
    if cm is not None:
        body["context_management"] = cm
    return client.post(path, json=body, headers={"anthropic-beta": "context-management-2025-06-27"})


def test_claude_codes_keep_all_edit_is_accepted_and_changes_nothing(client):
    msgs = tool_loop(2)
    plain = send(client, msgs)
    assert plain.status_code == 200, plain.text
    base = prompt_text(client.ctx, client.engine)
    r = send(client, msgs, CLAUDE_CODE_EDIT)
    assert r.status_code == 200, r.text
    assert prompt_text(client.ctx, client.engine) == base
    assert r.json()["context_management"] == {"applied_edits": []}
    assert "context_management" not in plain.json()


def test_clear_thinking_keeps_the_last_turns(client):
    msgs = tool_loop(3)
    r = send(client, msgs, {"edits": [{"type": "clear_thinking_20251015",
                                       "keep": {"type": "thinking_turns", "value": 1}}]})
    assert r.status_code == 200, r.text
    text = prompt_text(client.ctx, client.engine)
    assert "read file 0" not in text and "read file 1" not in text and "read file 2" in text
    (edit,) = r.json()["context_management"]["applied_edits"]
    assert edit["type"] == "clear_thinking_20251015" and edit["cleared_thinking_turns"] == 2
    assert edit["cleared_input_tokens"] > 0
    # The default keep is one turn, the same edit.
    send(client, msgs, {"edits": [{"type": "clear_thinking_20251015"}]})
    assert prompt_text(client.ctx, client.engine) == text


def test_clear_tool_uses_replaces_the_oldest_results(client):
    msgs = tool_loop(4)
    cm = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
                     "keep": {"type": "tool_uses", "value": 1}}]}
    full = send(client, msgs)
    full_len = len(client.engine.requests[-1].prompt_ids)
    r = send(client, msgs, cm)
    assert r.status_code == 200 and full.status_code == 200
    text = prompt_text(client.ctx, client.engine)
    assert text.count(TOOL_RESULT_PLACEHOLDER) == 3 and "contents of file number 3" in text
    assert "contents of file number 0" not in text
    assert '"f0.txt"' in text or "f0.txt" in text  # inputs stay unless clear_tool_inputs
    (edit,) = r.json()["context_management"]["applied_edits"]
    assert edit == {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3,
                    "cleared_input_tokens": full_len - len(client.engine.requests[-1].prompt_ids)}
    assert edit["cleared_input_tokens"] > 0


def test_clear_tool_uses_options(client):
    msgs = tool_loop(3)
    msgs[1]["content"][1]["name"] = "grep"  # the first call is a grep, which is excluded
    msgs[1]["content"][1]["input"] = {"q": "needle"}
    base = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
            "keep": {"type": "tool_uses", "value": 1}}
    r = send(client, msgs, {"edits": [{**base, "exclude_tools": ["grep"], "clear_tool_inputs": True}]},
             tools=(TOOL, GREP))
    text = prompt_text(client.ctx, client.engine)
    assert r.status_code == 200, r.text
    assert "contents of file number 0" in text  # grep's result is excluded
    assert "contents of file number 1" not in text and "contents of file number 2" in text
    assert "f1.txt" not in text and "f2.txt" in text  # the cleared call's input went too
    assert r.json()["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 1
    # Untriggered (two tool uses, trigger above) and too little to clear: the prompt is unedited.
    for edit in ({**base, "trigger": {"type": "tool_uses", "value": 5}},
                 {**base, "clear_at_least": {"type": "input_tokens", "value": 10 ** 6}}):
        r = send(client, msgs, {"edits": [edit]}, tools=(TOOL, GREP))
        assert r.status_code == 200 and r.json()["context_management"] == {"applied_edits": []}
        assert TOOL_RESULT_PLACEHOLDER not in prompt_text(client.ctx, client.engine)


def test_both_edits_in_order_and_count_tokens(client):
    msgs = tool_loop(3)
    cm = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
                    {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
                     "keep": {"type": "tool_uses", "value": 2}}]}
    r = send(client, msgs, cm)
    edits = r.json()["context_management"]["applied_edits"]
    assert [e["type"] for e in edits] == ["clear_thinking_20251015", "clear_tool_uses_20250919"]
    sent = len(client.engine.requests[-1].prompt_ids)
    counted = send(client, msgs, cm, path="/v1/messages/count_tokens")
    assert counted.status_code == 200, counted.text
    body = counted.json()
    assert body["input_tokens"] == sent
    assert body["context_management"]["original_input_tokens"] == \
        sent + sum(e["cleared_input_tokens"] for e in edits)
    assert "context_management" not in send(client, msgs, path="/v1/messages/count_tokens").json()


def test_the_stream_reports_applied_edits_in_message_delta(client):
    msgs = tool_loop(2)
    cm = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    r = send(client, msgs, cm, stream=True)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["context_management"]["applied_edits"][0]["cleared_thinking_turns"] == 1


@pytest.mark.parametrize("cm, code, param", [
    ({"edits": [{"type": "compact_20260112"}]}, "context_edit_not_supported", "context_management.edits[0].type"),
    ({"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]}, "invalid_value",
     "context_management.edits[1].type"),
    ({"edits": [{}]}, "missing_required_parameter", "context_management.edits[0].type"),
    ({"edits": "all"}, "invalid_type", "context_management.edits"),
    ("x", "invalid_type", "context_management"),
    ({"edits": [], "mode": "x"}, "unknown_parameter", "context_management.mode"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": "some"}]}, "invalid_value",
     "context_management.edits[0].keep"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "turns", "value": 1}}]}, "invalid_value",
     "context_management.edits[0].keep.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}]},
     "invalid_value", "context_management.edits[0].keep.value"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "messages", "value": 3}}]},
     "invalid_value", "context_management.edits[0].trigger.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "grep"}]}, "invalid_type",
     "context_management.edits[0].exclude_tools"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": 3}]}, "invalid_type",
     "context_management.edits[0].clear_tool_inputs"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "placeholder": "x"}]}, "unknown_parameter",
     "context_management.edits[0].placeholder"),
])
def test_edits_this_server_cannot_honour(client, cm, code, param):
    r = send(client, tool_loop(1), cm)
    check_error(r, 400, "invalid_request_error", code, param)
    if code == "context_edit_not_supported":
        assert "compact_20260112" in r.json()["error"]["message"]
    assert send(client, tool_loop(1), CLAUDE_CODE_EDIT).status_code == 200  # still serving
