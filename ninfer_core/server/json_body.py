"""Request bodies as JSON, refusing what a strict JSON parser and the rest of the server cannot take.

Python's json module accepts NaN, Infinity and -Infinity (not JSON), turns 1e999 into an infinity,
and recurses once per nesting level, so a body nested 10,000 deep raised RecursionError (a 500).
Here each of those is the client's 400 invalid_json, and nesting is bounded at MAX_DEPTH levels,
well above any real request (a JSON Schema inside a tool inside a message) and below every later
recursive step (validation, template rendering, schema compilation, json.dumps).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ninfer_core.engine.api import EngineError

MAX_DEPTH = 128


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:32]} is outside the range of a double")
    return v


def _too_deep(value: Any) -> bool:
    """Whether `value` nests more than MAX_DEPTH arrays/objects (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(v, dict):
            stack.extend((c, depth + 1) for c in v.values() if isinstance(c, (dict, list)))
        elif isinstance(v, list):
            stack.extend((c, depth + 1) for c in v if isinstance(c, (dict, list)))
    return False


def parse_json_body(raw: bytes | str) -> Any:
    """JSON of a request body, or EngineError invalid_json (400)."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(400, "invalid_json", f"The request body is not valid JSON: {e}") from None
    except ValueError as e:  # NaN / Infinity, or a number no double holds
        raise EngineError(400, "invalid_json", f"The request body is not valid JSON: {e}.") from None
    except RecursionError:
        raise EngineError(400, "invalid_json", f"The request body nests arrays and objects deeper than {MAX_DEPTH} "
                          "levels.") from None
    # Counting brackets is cheap; only a body that could be that deep is walked.
    if isinstance(value, (dict, list)) and _bracket_count(raw) > MAX_DEPTH and _too_deep(value):
        raise EngineError(400, "invalid_json", f"The request body nests arrays and objects deeper than {MAX_DEPTH} "
                          "levels.")
    return value


def _bracket_count(raw: bytes | str) -> int:
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return raw.count(b"[") + raw.count(b"{")
