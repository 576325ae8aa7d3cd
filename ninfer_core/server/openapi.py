"""GET /openapi.json: every route of the app with its request model, its answers and its error envelope.

The handlers read their bodies themselves (size limits, parsing off the event loop, the
protocol's own error codes), so FastAPI sees no body parameter; this module adds what the
document needs from the protocols' pydantic request models (chat, completions, llama.cpp,
tokenize, rerank, Responses, Anthropic Messages), the success shapes, and a `default` answer in the
route's error envelope: OpenAI's {"error": {message, type, param, code}} everywhere, Anthropic's
{"type": "error", "error": {...}, "request_id"} on /v1/messages*. A route a plugin mounts that
the table does not know is documented with a JSON-object body and the OpenAI envelope; a plugin can
name its model by setting `openapi_request_model` on the endpoint function.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from ninfer_core.server.errors import is_anthropic_path

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error", "request_id"], "properties": {
    "type": {"const": "error"}, "request_id": {"type": "string"}, "error": {
        "type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}, "code": {"type": "string"},
            "param": {"type": "string"}}}}}


def _obj(*required: str, **props: Any) -> dict:
    return {"type": "object", "required": list(required), "properties": props}


_STR, _INT = {"type": "string"}, {"type": "integer"}
_LIST = _obj("object", "data", object={"const": "list"}, data={"type": "array", "items": {"type": "object"}})
_MODEL = _obj("id", "object", id=_STR, object={"const": "model"})
# one server-sent event (stream: true), as an SSE parser reads it
_SSE = {"type": "object", "required": ["data"], "description": "Server-sent events (stream: true)",
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}}}
_RAW_RESULT = {"anyOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}]}

# (method, path) -> (request model import path or None, 200 JSON schema, streams, summary)
ROUTES: dict[tuple[str, str], tuple[str | None, dict, bool, str]] = {
    ("GET", "/health"): (None, _obj("status", "version", status={"const": "ok"}, version=_STR), False,
                         "Process health and build version"),
    ("GET", "/v1"): (None, _obj("object", "endpoints", object={"const": "ninfer.api_index"}), False, "Route index"),
    ("GET", "/v1/models"): (None, _LIST, False, "The served model"),
    ("GET", "/v1/models/{model_id}"): (None, _MODEL, False, "One model by id or alias"),
    ("GET", "/models"): (None, _LIST, False, "llama.cpp's model catalog (the one model)"),
    ("GET", "/props"): (None, _obj("default_generation_settings", "total_slots"), False, "llama.cpp server properties"),
    ("GET", "/v1/load"): (None, _obj("object", "capacity", "requests", object={"const": "ninfer.load"}), False,
                          "Capacity, load and token counters for gateways"),
    ("GET", "/stats"): (None, _obj("object", object={"const": "ninfer.stats"}), False, "Load plus engine counters"),
    ("GET", "/slots"): (None, {"type": "array", "items": {"type": "object"}}, False, "Context-cache cells"),
    ("POST", "/slots/{id_slot}"): (None, {"type": "object"}, False, "Save, restore or erase a slot"),
    ("POST", "/v1/chat/completions"): ("ninfer_core.protocols.openai_models:ChatCompletionRequest",
                                       _obj("id", "object", "choices", object={"const": "chat.completion"}), True,
                                       "OpenAI Chat Completions"),
    ("POST", "/v1/chat/completions/input_tokens"): ("ninfer_core.protocols.openai_models:ChatCompletionRequest",
                                                    _obj("input_tokens", input_tokens=_INT), False,
                                                    "Prompt tokens of a chat request"),
    ("POST", "/v1/completions"): ("ninfer_core.protocols.openai_completions:CompletionRequest",
                                  _obj("id", "object", "choices", object={"const": "text_completion"}), True,
                                  "OpenAI legacy completion of a raw prompt"),
    ("POST", "/completion"): ("ninfer_core.protocols.llamacpp:LlamaCompletionRequest", _RAW_RESULT, True,
                              "llama.cpp completion of a raw prompt"),
    ("POST", "/tokenize"): ("ninfer_core.protocols.tokenize_routes:TokenizeRequest",
                            _obj("tokens", tokens={"type": "array"}), False, "Tokenize text"),
    ("POST", "/detokenize"): ("ninfer_core.protocols.tokenize_routes:DetokenizeRequest",
                              _obj("content", content=_STR), False, "Token ids to text"),
    ("POST", "/apply-template"): ("ninfer_core.protocols.openai_models:ChatCompletionRequest",
                                  _obj("prompt", prompt=_STR), False, "The prompt a chat request renders to"),
    ("POST", "/v1/rerank"): ("ninfer_core.protocols.rerank:RerankRequest", _obj("results", results={"type": "array"}),
                             False, "Documents ranked by relevance"),
    ("POST", "/v1/responses"): ("ninfer_core.protocols.responses_models:CreateResponseRequest",
                                _obj("id", "object", object={"const": "response"}), True, "OpenAI Responses"),
    ("POST", "/v1/responses/input_tokens"): ("ninfer_core.protocols.responses_models:InputTokensRequest",
                                             _obj("object", "input_tokens", input_tokens=_INT), False,
                                             "Prompt tokens of a Responses request"),
    ("POST", "/v1/responses/compact"): (None, {"type": "object"}, False, "Compaction (not supported: 400)"),
    ("GET", "/v1/responses/{response_id}"): (None, _obj("id", "object", object={"const": "response"}), False,
                                             "A stored Response"),
    ("DELETE", "/v1/responses/{response_id}"): (None, _obj("id", "deleted", deleted={"type": "boolean"}), False,
                                                "Delete a stored Response"),
    ("GET", "/v1/responses/{response_id}/input_items"): (None, _LIST, False, "A stored Response's input Items"),
    ("POST", "/v1/responses/{response_id}/cancel"): (None, {"type": "object"}, False, "Cancel a Response"),
    ("POST", "/v1/messages"): ("ninfer_core.protocols.anthropic_models:MessagesRequest",
                               _obj("id", "type", "content", type={"const": "message"}), True, "Anthropic Messages"),
    ("POST", "/v1/messages/count_tokens"): ("ninfer_core.protocols.anthropic_models:CountTokensRequest",
                                            _obj("input_tokens", input_tokens=_INT), False,
                                            "Anthropic token count"),
    # the llama.cpp WebUI's routes (protocols/webui.py)
    ("POST", "/v1/streams/lookup"): (None, {"type": "array", "items": {"type": "object"}}, False,
                                     "Resumable streams of the given conversation ids"),
    ("GET", "/v1/stream"): (None, {"type": "object"}, True, "Resume a stream (X-Conversation-Id)"),
    ("DELETE", "/v1/stream"): (None, {"type": "object"}, False, "Forget a resumable stream"),
    ("POST", "/v1/chat/completions/control"): (None, {"type": "object"}, False,
                                               "Control of a streamed completion (reasoning_end)"),
}
# Second spellings answer exactly as their first one.
ALIASES = {"/v1/health": "/health", "/chat/completions": "/v1/chat/completions",
           "/chat/completions/input_tokens": "/v1/chat/completions/input_tokens", "/completions": "/completion",
           "/rerank": "/v1/rerank", "/reranking": "/v1/rerank", "/v1/reranking": "/v1/rerank",
           "/responses": "/v1/responses", "/responses/input_tokens": "/v1/responses/input_tokens"}
NO_BODY = {("POST", "/v1/responses/{response_id}/cancel")}
QUERY = {("POST", "/slots/{id_slot}"): [{"name": "action", "in": "query", "required": True,
                                         "schema": {"type": "string", "enum": ["save", "restore", "erase"]}}],
         ("GET", "/v1/responses/{response_id}"): [{"name": "stream", "in": "query", "required": False,
                                                   "schema": {"type": "boolean"}}]}


def _load(target: str) -> Any:
    import importlib

    mod, _, name = target.partition(":")
    return getattr(importlib.import_module(mod), name)


def _model_schema(model: Any, components: dict) -> dict:
    name = model.__name__
    if name not in components:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for dname, d in schema.pop("$defs", {}).items():
            components.setdefault(dname, d)
        components[name] = schema
    return {"$ref": f"#/components/schemas/{name}"}


def build_openapi(app: FastAPI, api_key: bool) -> dict:
    """The document, built once per app and kept."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("ValidationError", "HTTPValidationError"):  # FastAPI's 422 shapes: NInfer answers 400
        components.pop(name, None)
    components["OpenAIError"] = OPENAI_ERROR
    components["AnthropicError"] = ANTHROPIC_ERROR
    endpoints = {(m, r.path_format): r.endpoint for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            key = (method.upper(), ALIASES.get(path, path))
            request, ok, streams, summary = ROUTES.get(key, (None, {"type": "object"}, False, ""))
            plugin_model = getattr(endpoints.get((method.upper(), path)), "openapi_request_model", None)
            if summary:
                op["summary"] = summary
            op.setdefault("parameters", []).extend(QUERY.get(key, []))
            if not op["parameters"]:
                op.pop("parameters")
            model = plugin_model or (_load(request) if request else None)
            if model is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _model_schema(model, components)}}}
            elif method.upper() == "POST" and key not in NO_BODY:
                op["requestBody"] = {"required": False, "content": {"application/json": {
                    "schema": {"type": "object"}}}}
            content: dict[str, Any] = {"application/json": {"schema": ok}}
            if key == ("GET", "/metrics"):
                content = {"text/plain": {"schema": _STR}}
            elif streams:
                content["text/event-stream"] = {"schema": _SSE}
            error = "AnthropicError" if is_anthropic_path(path) else "OpenAIError"
            op["responses"] = {"200": {"description": "OK", "content": content},
                               "default": {"description": "An error in the route's envelope", "content": {
                                   "application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}}}}
            if method.upper() == "HEAD":
                op["responses"]["200"] = {"description": "OK (no body)"}
            if api_key and key[1] not in ("/health",):
                op["security"] = [{"bearer": []}, {"x-api-key": []}]
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return doc


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """Serve the document at /openapi.json (FastAPI's route) from `build_openapi`, built once."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, api_key)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
