"""Message boundaries of a chat template, learned once from the template itself.

The context cache checkpoints a chat prompt at its turn closure (the frontier before the assistant
opener of the open turn) and at message starts. Templates open a message with different control
tokens and name the roles differently (`model` for the assistant in some). Instead of a table of
known templates, `learn_turn_markers` renders probe conversations whose message contents are known
words and reads off:

* the *start token*: the control token that opens every message and the generation prompt, i.e.
  the one whose occurrences split the probe so that the user, assistant and user contents fall in
  successive pieces and the last piece (the generation prompt) holds no content; the earliest such
  token wins (a header-start token over its header-end);
* the *role heads*: the text between a start token and each role's content (`user\\n`,
  `assistant\\n`, `model\\n`, and a tool result's head when it differs from a user query's).

`hints_from_markers` then finds the same frontiers in a real prompt by token id and by decoding a
short window after each start token. A template the probe cannot read (no such control token, a
template that refuses the probe, roles that cannot be told apart) yields None: the server logs one
line at startup and chat prompts get no turn-closure or boundary hints (endpoints, long anchors and
explicit markers still apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_core.engine.checkpoints import CheckpointHints

ROLE_WINDOW = 24  # tokens decoded after a start token to read the role head

# Probe contents: plain lowercase words no template adds and no tokenizer splits oddly around.
_SYS, _U1, _A2, _U3, _TOOL = "zqsysprobe", "zqfirstprobe", "zqanswerprobe", "zqsecondprobe", "zqtoolprobe"


@dataclass(frozen=True)
class TurnMarkers:
    start_id: int  # the control token every message and the generation prompt begin with
    assistant: str  # the assistant role head (first line), e.g. "assistant" or "model"
    user: str  # the user role head (first line)
    system: str | None  # the system role head, None when the template folds the system into a user turn
    tool: str | None  # a tool result's head when it differs from a user query's ("user\n" + a result opener)

    def role(self, head: str) -> str | None:
        """The role a decoded window after a start token begins with (the longest head wins)."""
        heads = [(h, r) for h, r in ((self.tool, "tool"), (self.assistant, "assistant"), (self.user, "user"),
                                     (self.system, "system")) if h]
        for h, r in sorted(heads, key=lambda x: -len(x[0])):
            if head.startswith(h):
                return r
        return None


def _control_ids(tokenizer: Any) -> dict[int, str]:
    added = getattr(tokenizer, "added_tokens", None)
    if not isinstance(added, dict):
        return {}
    return {int(i): t for t, i in added.items()}


def _render(template: Any, tokenizer: Any, messages: list[dict]) -> list[int]:
    """The probe's ids as a request's are made (markup as control tokens, data as text), through
    render_segments so a probe is not mistaken for a request's render."""
    added = getattr(tokenizer, "added_tokens", None)
    ids: list[int] = []
    for text, markup in template.render_segments(messages, add_generation_prompt=True, control_tokens=list(added)):
        ids.extend(tokenizer.encode(text, allow_special=markup))
    return ids


def _pieces(ids: list[int], start_id: int) -> list[list[int]]:
    """ids split before every occurrence of start_id (piece 0: what precedes the first one)."""
    out: list[list[int]] = [[]]
    for t in ids:
        if t == start_id:
            out.append([])
        else:
            out[-1].append(t)
    return out


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0].rstrip()


def _head(text: str, marker: str) -> str | None:
    at = text.find(marker)
    return None if at < 0 else text[:at]


def learn_turn_markers(template: Any, tokenizer: Any) -> TurnMarkers | None:
    """The template's message opener and role heads, or None when the probe cannot read them."""
    decode = getattr(tokenizer, "decode", None)
    controls = _control_ids(tokenizer)
    if template is None or not callable(decode) or not controls or not hasattr(template, "render_segments"):
        return None
    probe = [{"role": "system", "content": _SYS}, {"role": "user", "content": _U1},
             {"role": "assistant", "content": _A2}, {"role": "user", "content": _U3}]
    try:
        ids = _render(template, tokenizer, probe)
    except Exception:  # noqa: BLE001 - a template that refuses the probe gives no markers
        return None
    seen: list[int] = []
    for t in ids:
        if t in controls and t not in seen:
            seen.append(t)  # candidates in order of first occurrence
    for cand in seen:
        texts = [decode(p, skip_special=False) for p in _pieces(ids, cand)]

        def where(marker: str, texts: list[str] = texts) -> int | None:
            return next((i for i, s in enumerate(texts) if marker in s), None)

        s, u1, a2, u3 = where(_SYS), where(_U1), where(_A2), where(_U3)
        if None in (u1, a2, u3) or not (0 < u1 < a2 < u3 < len(texts) - 1):
            continue
        if s is not None and not 0 < s <= u1:
            continue
        if any(m in texts[-1] for m in (_SYS, _U1, _A2, _U3)):
            continue
        user_head, asst_head = _head(texts[u3], _U3), _head(texts[a2], _A2)
        gen_head = texts[-1]
        user, assistant = _first_line(user_head or ""), _first_line(asst_head or "")
        if not user or not assistant or not _first_line(gen_head).startswith(assistant):
            continue
        if user.startswith(assistant) or assistant.startswith(user):
            continue  # roles that cannot be told apart by their heads
        system = None
        if s is not None and s < u1:
            system = _first_line(_head(texts[s], _SYS) or "") or None
        return TurnMarkers(cand, assistant, user, system, _learn_tool_head(template, tokenizer, cand, user_head))
    return None


def _learn_tool_head(template: Any, tokenizer: Any, start_id: int, user_head: str | None) -> str | None:
    """A tool result's head when the template renders one unlike a user query's, else None."""
    probe = [{"role": "user", "content": _U1},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "zqfn", "arguments": {}}}]},
             {"role": "tool", "content": _TOOL}]
    try:
        ids = _render(template, tokenizer, probe)
    except Exception:  # noqa: BLE001 - no tool messages in this template
        return None
    for p in _pieces(ids, start_id):
        text = tokenizer.decode(p, skip_special=False)
        head = _head(text, _TOOL)
        if head is not None:
            head = head.rstrip()
            if not head or head == (user_head or "").rstrip():
                return None
            return head
    return None


def hints_from_markers(markers: TurnMarkers, tokenizer: Any, prompt: list[int],
                       preserve_thinking: bool | None = None) -> CheckpointHints:
    """CheckpointHints of a chat prompt rendered with the template `markers` were learned from:
    the rules of `checkpoints.derive_hints`, by the learned start token and role heads."""
    occ = [i for i, t in enumerate(prompt) if t == markers.start_id]
    if not occ:
        return CheckpointHints()
    starts = [i for i in occ[1:] if i > 0]  # the first message's opener has nothing reusable before it
    hints = CheckpointHints(boundaries=starts[:-1])
    if starts:
        hints.turn_closure = starts[-1]
    roles = [markers.role(tokenizer.decode(prompt[i + 1: i + 1 + ROLE_WINDOW], skip_special=False)) for i in occ]
    if len(starts) >= 2 and markers.system is not None and roles[0] == "system":
        hints.stable_prefix = starts[0]
    if not preserve_thinking and hints.turn_closure is not None:
        last_query = max((i for i, r in zip(occ, roles) if r == "user"), default=None)
        if last_query is not None:
            first = next((i for i, r in zip(occ, roles) if r == "assistant" and i > last_query), None)
            if first is not None and first < hints.turn_closure:
                hints.rolling_closure, hints.turn_closure = hints.turn_closure, first
    return hints



def template_turn_markers(template: Any, tokenizer: Any) -> TurnMarkers | None:
    """`learn_turn_markers`, probed once per (template object, tokenizer) and kept on the template."""
    if template is None:
        return None
    cached = getattr(template, "_ninfer_turn_markers", None)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    markers = learn_turn_markers(template, tokenizer)
    try:
        template._ninfer_turn_markers = (tokenizer, markers)
    except AttributeError:  # pragma: no cover - a template object that takes no attributes
        pass
    return markers
