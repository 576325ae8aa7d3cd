"""Checkpoints of the context cache: KV pages plus a StateImage at an exact token frontier.

Pure bookkeeping, no model calls. A `Checkpoint` holds one reference on each KV page covering
[0, frontier) and one StateImage, either in a Device state slot (a runner slot beyond the lanes)
or as a Host copy (`StateImage`). Holders (continuations, shared prefixes, requests resuming from
it) count in `refs`; the last one to let go returns its pages and state to the pools.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

from ninfer_core.engine.model_api import StateImage

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1

# Reuse paths (spec "Execution behavior" and ninfer:context_selections_total{source}).
SOURCES = ("root", "private_endpoint", "private_turn_closure", "private_response_replay",
           "private_long_anchor", "shared_stable_prefix")
KIND_SOURCE = {"endpoint": "private_endpoint", "turn_closure": "private_turn_closure",
               "response_replay": "private_response_replay", "long_anchor": "private_long_anchor",
               "shared": "shared_stable_prefix"}


def session_digest(tokens) -> str:
    """FNV-1a 64 over the token ids (one id per step), as 16 hex characters."""
    h = FNV_OFFSET
    for t in tokens:
        h = ((h ^ (int(t) & MASK64)) * FNV_PRIME) & MASK64
    return f"{h:016x}"


_ids = itertools.count(1)


@dataclass(eq=False)
class Checkpoint:
    """KV pages [0, frontier) and the recurrent state after exactly `tokens` (len == frontier)."""

    tokens: tuple[int, ...]
    pages: list[int]  # pages_for(frontier) page ids, one reference each
    device_slot: int | None = None  # runner state slot holding the StateImage, or
    image: StateImage | None = None  # its Host copy
    refs: int = 0
    last_used: float = 0.0
    id: int = field(default_factory=lambda: next(_ids))
    # Demoted: Host KV pages (cache_host.HostPagePool ids) covering [0, frontier), `pages` empty.
    host_pages: list[int] = field(default_factory=list)
    pins: int = 0  # running requests that will copy from it (never demoted meanwhile)

    @property
    def frontier(self) -> int:
        return len(self.tokens)

    @property
    def host_kv(self) -> list[int] | None:
        """The Host KV pages when its KV was demoted to Host memory, else None."""
        return self.host_pages or None

    @property
    def tier(self) -> str:
        return "device" if self.device_slot is not None else "host"

    @cached_property
    def digest(self) -> str:
        return session_digest(self.tokens)

    def matches(self, prompt: list[int]) -> bool:
        """True when the prompt starts with this checkpoint's tokens and runs past them."""
        f = len(self.tokens)
        return f < len(prompt) and tuple(prompt[:f]) == self.tokens


@dataclass(eq=False)
class Entry:
    """A checkpoint as one owner keeps it: the kind says which reuse path it serves."""

    kind: str  # endpoint | turn_closure | long_anchor | response_replay | shared
    ckpt: Checkpoint


@dataclass(eq=False)
class Continuation:
    """A private context-cache cell (a /slots slot): one retained conversation's checkpoints."""

    slot: int
    session: tuple[int, ...]  # every token of the session, the last sampled one included
    entries: list[Entry]
    last_used: float = 0.0
    busy: int = 0  # active requests that resumed from it (is_processing)
    filename: str | None = None  # bound slot file (last save/restore)
    file_depth: int = 0  # session tokens the bound file held at its last save or restore
    session_id: str | None = None  # the Responses chain it belongs to (its replay checkpoint's key)

    @cached_property
    def digest(self) -> str:
        return session_digest(self.session)

    def endpoint(self) -> Entry | None:
        return next((e for e in self.entries if e.kind == "endpoint"), None)

    def deepest(self) -> Checkpoint | None:
        return max((e.ckpt for e in self.entries), key=lambda c: c.frontier, default=None)


@dataclass
class CheckpointHints:
    """Where a prompt's reusable frontiers are, as the server knows them from the template.

    turn_closure: the frontier before the assistant opener of the open turn (preserve_thinking
    false: the first assistant opener after the last user query, so closing a tool loop, which drops
    its reasoning, still resumes there; true: the current response's opener); rolling_closure: with
    preserve false in an open tool loop, the current response's opener too (the next step of the
    loop resumes there while the turn stays open); boundaries: message starts (long-anchor
    candidates); stable_prefix: the end of the system/tools prefix that other conversations may
    share; markers: explicit client cache markers; replay: the end of the stored Responses history a
    request replays (previous_response_id), kept as the session's replay checkpoint.
    """

    turn_closure: int | None = None
    boundaries: list[int] = field(default_factory=list)
    stable_prefix: int | None = None
    markers: list[int] = field(default_factory=list)
    rolling_closure: int | None = None
    replay: int | None = None


def hints_from_chat_tokens(prompt: list[int], opener: int | None, system_first: bool | None = None
                           ) -> CheckpointHints:
    """Derive hints from a rendered chat prompt: every `opener` (the format's turn opener) starts a
    message.

    The last one opens the assistant turn (its position is the turn closure); the second one ends
    the first message, which is the stable prefix when that message is the system prompt.
    """
    if opener is None:
        return CheckpointHints()
    starts = [i for i, t in enumerate(prompt) if t == opener and i > 0]
    hints = CheckpointHints(boundaries=starts[:-1])
    if starts:
        hints.turn_closure = starts[-1]
    if len(starts) >= 2 and system_first is not False:
        hints.stable_prefix = starts[0]
    return hints


def derive_hints(tokenizer, prompt: list[int], preserve_thinking: bool | None = None) -> CheckpointHints:
    """Hints for a request that brought none: message starts at the turn opener of the tokenizer's
    chat format (`ChatFormat.turn_opener`), when it states one and the tokenizer has it.

    preserve_thinking (spec "Execution behavior") selects the turn closure: true, the current
    response's opener, since every past reasoning block is rendered again as it ran; false or
    unknown (the template default), the first assistant opener after the last user query, because
    closing a tool loop re-renders its assistant turns without their reasoning. In an open tool loop
    the current opener is kept as well (`rolling_closure`) for the loop's next step."""
    from ninfer_core.tokenizer.chat_format import chat_format_of, token_id

    fmt = chat_format_of(tokenizer)
    opener = token_id(tokenizer, fmt.turn_opener)
    if opener is None:
        return CheckpointHints()
    system = tokenizer.encode(fmt.system_role, allow_special=False) if hasattr(tokenizer, "encode") else []
    system_first = bool(system) and prompt[:1] == [opener] and prompt[1: 1 + len(system)] == system
    hints = hints_from_chat_tokens(prompt, opener, system_first)
    if not preserve_thinking and hints.turn_closure is not None:
        first = _open_turn_opener(tokenizer, fmt, prompt, opener)
        if first is not None and first < hints.turn_closure:
            hints.rolling_closure, hints.turn_closure = hints.turn_closure, first
    return hints


ROLE_WINDOW = 24  # tokens after the turn opener: enough to read a role and a tool result's opening


def _open_turn_opener(tokenizer, fmt, prompt: list[int], opener: int) -> int | None:
    """The position of the first assistant opener after the last user query (a user turn that is
    not a tool result), or None when the roles cannot be read."""
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        return None
    last_query = None
    openers: list[int] = []
    user = fmt.user_role
    for i, t in enumerate(prompt):
        if t != opener:
            continue
        try:
            head = decode(prompt[i + 1: i + 1 + ROLE_WINDOW], skip_special=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode gives no hint
            return None
        if head.startswith(fmt.assistant_role):
            openers.append(i)
        elif head.startswith(user) and not (
                fmt.tool_result_open and head[len(user):].lstrip("\n").startswith(fmt.tool_result_open)):
            last_query = i
    if last_query is None:
        return None
    return next((i for i in openers if i > last_query), None)
