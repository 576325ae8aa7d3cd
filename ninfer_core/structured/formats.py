"""Response formats as each protocol sends them, read into one `ResponseFormat`.

- Chat Completions and the raw routes: response_format {"type": "text" | "json_object" |
  "json_schema", "json_schema": {"name", "description", "schema", "strict"}}; llama.cpp's
  json_object with a "schema" is accepted too.
- Responses: text.format, the flat form {"type": "json_schema", "name", "schema", "strict", ...}.
- Anthropic Messages: output_config.format (and the older output_format) {"type": "json_schema",
  "schema"}, always strict.
- llama.cpp /completion and /v1/completions: json_schema (the bare schema; {} admits any JSON
  object) and grammar (GBNF).

A JSON format needs --structured-output; without it the request is refused with
response_format_not_supported, or generated unconstrained under --unconstrained-response-format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ninfer_core.engine.api import EngineError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "json_object" | "json_schema" | "grammar"
    param: str  # where the request named it (errors point here)
    schema: Any = None  # json_schema: the schema (dict or bool)
    strict: bool = False
    name: str | None = None
    description: str | None = None
    grammar: str | None = None  # GBNF text
    schema_param: str = ""  # where the schema sits, for errors inside it


def _bad(code: str, message: str, param: str) -> EngineError:
    return EngineError(400, code, message, param=param)


def _schema_value(v: Any, param: str) -> Any:
    if v is None:
        return {}
    if not isinstance(v, (dict, bool)):
        raise _bad("invalid_type", f"'{param}' must be a JSON Schema object.", param)
    return v


def _strict(v: Any, param: str) -> bool:
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad("invalid_type", f"'{param}' must be a boolean.", param)
    return v


def _opt_str(v: Any, param: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _bad("invalid_type", f"'{param}' must be a string.", param)
    return v


def chat_response_format(rf: Any, param: str = "response_format") -> ResponseFormat | None:
    """Chat Completions / raw routes response_format; None for text (or absent)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("invalid_type", f"{param} must be an object.", param)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama.cpp's extension: a schema beside json_object
        if schema is not None:
            return ResponseFormat(
                "json_schema", param, _schema_value(schema, f"{param}.schema"), schema_param=f"{param}.schema"
            )
        return ResponseFormat("json_object", param)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        p = f"{param}.json_schema"
        if spec is None and "schema" in rf:  # some clients send the schema flat
            spec, p = rf, param
        if not isinstance(spec, dict):
            raise _bad(
                "missing_required_parameter" if spec is None else "invalid_type",
                f"{param}.json_schema must be an object with the schema.",
                f"{param}.json_schema",
            )
        name = _opt_str(spec.get("name"), f"{p}.name")
        if name is not None and not NAME.match(name):
            raise _bad("invalid_value", f"{p}.name must be 1-64 letters, digits, '_' or '-'.", f"{p}.name")
        return ResponseFormat(
            "json_schema",
            param,
            _schema_value(spec.get("schema"), f"{p}.schema"),
            strict=_strict(spec.get("strict"), f"{p}.strict"),
            name=name,
            description=_opt_str(spec.get("description"), f"{p}.description"),
            schema_param=f"{p}.schema",
        )
    raise _bad("invalid_value", f"{param}.type must be text, json_object or json_schema.", f"{param}.type")


def responses_text_format(fmt: Any, param: str = "text.format") -> ResponseFormat | None:
    """Responses text.format (flat json_schema form); None for text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("invalid_type", f"'{param}' must be an object.", param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", param)
    if kind == "json_schema":
        if "schema" not in fmt:
            raise _bad(
                "missing_required_parameter",
                f"'{param}.schema' is required for json_schema.",
                f"{param}.schema",
            )
        name = _opt_str(fmt.get("name"), f"{param}.name")
        if name is not None and not NAME.match(name):
            raise _bad(
                "invalid_value", f"{param}.name must be 1-64 letters, digits, '_' or '-'.", f"{param}.name"
            )
        return ResponseFormat(
            "json_schema",
            param,
            _schema_value(fmt.get("schema"), f"{param}.schema"),
            strict=_strict(fmt.get("strict"), f"{param}.strict"),
            name=name,
            description=_opt_str(fmt.get("description"), f"{param}.description"),
            schema_param=f"{param}.schema",
        )
    raise _bad(
        "invalid_value",
        f"text.format type {json.dumps(kind)[:40]} is not text, json_object or json_schema.",
        f"{param}.type",
    )


def anthropic_output_format(fmt: Any, param: str) -> ResponseFormat:
    """output_config.format / output_format: {"type": "json_schema", "schema": {...}}, always strict."""
    if not isinstance(fmt, dict):
        raise _bad("invalid_type", f"'{param}' must be an object.", param)
    if fmt.get("type") != "json_schema":
        raise _bad("invalid_value", f"'{param}.type' must be json_schema.", f"{param}.type")
    if "schema" not in fmt:
        raise _bad("missing_required_parameter", f"'{param}.schema' is required.", f"{param}.schema")
    return ResponseFormat(
        "json_schema",
        param,
        _schema_value(fmt.get("schema"), f"{param}.schema"),
        strict=True,
        schema_param=f"{param}.schema",
    )


def llamacpp_json_schema(schema: Any, param: str = "json_schema") -> ResponseFormat | None:
    """llama.cpp's json_schema: the bare schema; {} admits any JSON object."""
    if schema is None:
        return None
    if not isinstance(schema, (dict, bool)):
        raise _bad("invalid_type", f"{param} must be a JSON Schema object.", param)
    if schema == {}:
        return ResponseFormat("json_object", param)
    return ResponseFormat("json_schema", param, schema, schema_param=param)


def llamacpp_grammar(text: Any, param: str = "grammar") -> ResponseFormat | None:
    """llama.cpp's grammar field: GBNF text; empty means none."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise _bad("invalid_type", f"{param} must be a string.", param)
    if not text.strip():
        return None
    return ResponseFormat("grammar", param, grammar=text)


def admit(fmt: ResponseFormat | None, options: Any) -> ResponseFormat | None:
    """The format the request runs with: refused without --structured-output, dropped (generated
    unconstrained) with --unconstrained-response-format."""
    if fmt is None:
        return None
    if getattr(options, "structured_output", False):
        return fmt
    if getattr(options, "unconstrained_response_format", False):
        return None
    what = "A GBNF grammar" if fmt.kind == "grammar" else f"The {fmt.kind} response format"
    code = {"grammar": "grammar_not_supported", "json_schema": "json_schema_not_supported"}.get(
        fmt.param, "response_format_not_supported"
    )
    raise _bad(
        code,
        f"{what} ({fmt.param}) needs a server started with --structured-output, which enforces it "
        "token by token; this server was started without it.",
        fmt.param,
    )


def refuse_conflicts(
    fmt: ResponseFormat | None,
    *,
    stop: list | None = None,
    stop_param: str = "stop",
    ignore_eos: bool = False,
) -> None:
    """Options a constrained request cannot have (spec: custom stops are rejected)."""
    if fmt is None:
        return
    if stop:
        raise _bad(
            "stop_not_supported",
            f"Custom stop strings cannot be combined with a constrained response "
            f"format ({fmt.param}): a stop string would cut the document short.",
            stop_param,
        )
    if ignore_eos:
        raise _bad(
            "ignore_eos_not_supported",
            f"ignore_eos cannot be combined with a constrained response "
            f"format ({fmt.param}): the grammar ends the output when the document is complete.",
            "ignore_eos",
        )


def instruction(fmt: ResponseFormat, tools: bool) -> str:
    """The leading instruction exposing the format to the model (spec "Structured output")."""
    if fmt.kind == "json_object":
        text = "Answer with a single JSON object, as raw JSON without Markdown code fences."
    else:
        schema = json.dumps(fmt.schema, ensure_ascii=False)
        named = f" named {fmt.name}" if fmt.name else ""
        desc = f" ({fmt.description})" if fmt.description else ""
        text = (
            f"Answer with a single JSON value{named}{desc} that follows this JSON Schema, as raw JSON "
            f"without Markdown code fences:\n{schema}"
        )
    if tools:
        text += "\nYou may call the available tools first to gather information; give the final answer as that JSON."
    return text


def with_instruction(messages: list[dict], fmt: ResponseFormat | None, tools: bool) -> list[dict]:
    """The chat messages with the format instruction leading the system message (or as one)."""
    if fmt is None or fmt.kind == "grammar":
        return messages
    text = instruction(fmt, tools)
    out = list(messages)
    if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
        first = dict(out[0])
        first["content"] = text + ("\n\n" + first["content"] if first["content"] else "")
        out[0] = first
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
