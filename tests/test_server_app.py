"""The HTTP layer around any protocol: readiness, headers, auth, CORS, body limit, errors, mounting.

Unit tests over FastAPI's TestClient and a FakeEngine (tests/conftest.py); the real server is
covered in tests/e2e.
"""

from __future__ import annotations

import sys
import types

import pytest

from ninfer_core import hookimpl
from ninfer_core.version import build_string

HI = {"messages": [{"role": "user", "content": "Hi"}]}


def _check_envelope(r, status, code, type_=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param
    if type_:
        assert err["type"] == type_
    assert r.headers["x-ninfer-version"] == build_string()
    assert r.headers["x-request-id"].startswith("req_")


def test_every_route_answers_503_until_ready(make_app):
    client, ctx, _ = make_app(ready=False, cors=True)
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("OPTIONS", "/v1/chat/completions"), ("GET", "/no/such/route")]:
        r = client.request(method, path, headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"})
        _check_envelope(r, 503, "model_loading", "service_unavailable")
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["message"] == "The model is still loading. Retry shortly."
    ctx.mark_ready()
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "version": build_string()}


def test_loading_503_comes_before_auth(make_app):
    client, _, _ = make_app(ready=False, api_key="k")
    _check_envelope(client.get("/v1/models"), 503, "model_loading")


def test_version_and_unique_request_ids(make_app):
    client, _, _ = make_app()
    ids = set()
    for path in ("/health", "/v1/models", "/props", "/v1/load", "/v1"):
        r = client.get(path)
        assert r.status_code == 200
        assert r.headers["x-ninfer-version"] == build_string()
        ids.add(r.headers["x-request-id"])
    assert len(ids) == 5
    r = client.post("/v1/chat/completions", json={**HI, "stream": True})
    assert r.headers["x-request-id"].startswith("req_")


def test_unknown_route_and_method_use_the_envelope(make_app):
    client, _, _ = make_app()
    _check_envelope(client.get("/v1/nope"), 404, "not_found", "invalid_request_error")
    _check_envelope(client.get("/v1/chat/completions"), 405, "method_not_allowed")


def test_doubled_v1_prefix(make_app):
    client, _, _ = make_app()
    assert client.get("/v1/v1/models").json() == client.get("/v1/models").json()
    r = client.post("/v1/v1/chat/completions", json=HI)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    _check_envelope(client.post("/v1/v1/chat/completions", json={"messages": []}), 400, "invalid_value",
                    param="messages")
    assert client.get("/v1/v1/props").status_code == 404  # only /v1/... paths are doubled


@pytest.mark.parametrize("headers,ok", [
    ({"Authorization": "Bearer sekret"}, True),
    ({"authorization": "bearer sekret"}, True),
    ({"x-api-key": "sekret"}, True),
    ({"Authorization": "Bearer wrong"}, False),
    ({"Authorization": "sekret"}, False),
    ({"x-api-key": "sekret2"}, False),
    ({}, False),
])
def test_api_key(make_app, headers, ok):
    client, _, _ = make_app(api_key="sekret")
    r = client.get("/v1/models", headers=headers)
    if ok:
        assert r.status_code == 200
    else:
        _check_envelope(r, 401, "invalid_api_key", "authentication_error")
        assert "sekret" not in r.text


def test_api_key_exemptions(make_app):
    client, _, _ = make_app(api_key="sekret")
    assert client.get("/health").status_code == 200
    assert client.get("/v1/health").json()["status"] == "ok"  # llama-server's public second spelling
    for path in ("/v1/load", "/props", "/v1", "/v1/models/test-model"):
        assert client.get(path).status_code == 401
    _check_envelope(client.post("/v1/chat/completions", json=HI), 401, "invalid_api_key")
    # A preflight is never asked for the key (without --cors nothing answers it: 405).
    pre = client.options("/v1/chat/completions", headers={"Origin": "http://x",
                                                          "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 405


def test_cors(make_app):
    client, _, _ = make_app(cors=True, api_key="k")
    pre = client.options("/v1/chat/completions", headers={
        "Origin": "http://ui.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization, X-Conversation-Id"})
    # llama-server's preflight: 200, the Origin reflected, credentials allowed
    assert pre.status_code == 200 and pre.content == b""
    assert pre.headers["access-control-allow-origin"] == "http://ui.test"
    assert pre.headers["access-control-allow-credentials"] == "true"
    allowed = pre.headers["access-control-allow-headers"]
    assert "x-conversation-id" in allowed and "authorization" in allowed
    assert pre.headers["x-ninfer-version"]
    r = client.get("/v1/models", headers={"Origin": "http://ui.test", "Authorization": "Bearer k"})
    assert r.headers["access-control-allow-origin"] == "http://ui.test" and r.headers["vary"] == "Origin"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    # Without an Origin the headers are not added; without --cors never.
    assert "access-control-allow-origin" not in client.get("/health").headers
    plain, _, _ = make_app()
    assert "access-control-allow-origin" not in plain.get("/health", headers={"Origin": "http://x"}).headers


def test_body_limit_before_json_parsing(make_app):
    client, _, engine = make_app(max_request_mib=1)
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (1 << 20) + b'"}]}'
    _check_envelope(client.post("/v1/chat/completions", content=big,
                                headers={"content-type": "application/json"}), 413, "request_too_large")

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}]}'

    _check_envelope(client.post("/v1/chat/completions", content=chunks()), 413, "request_too_large")
    assert engine.requests == []
    assert client.post("/v1/chat/completions", json=HI).status_code == 200


def test_models_props_load_and_index(make_app):
    client, _, _ = make_app(engine_options={"max_concurrency": 2, "seed": 7, "default_max_tokens": 99})
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    m = models["data"][0]
    assert m["id"] == "test-model" and m["object"] == "model"
    assert m["max_model_len"] == m["context_window"] == m["context_length"] == 8192
    assert m["meta"] == {"n_vocab": m["meta"]["n_vocab"], "n_ctx": 8192, "n_ctx_train": 32768, "n_embd": 64,
                         "n_params": 1000, "size": 4000, "ftype": "f32"}
    assert client.get("/v1/models/test-model").json() == m
    _check_envelope(client.get("/v1/models/other"), 404, "model_not_found", param="model")
    props = client.get("/props").json()
    assert props["total_slots"] == 2 and props["model_alias"] == "test-model"
    assert props["model_path"] == "/models/test.ninfer"
    params = props["default_generation_settings"]["params"]
    assert params["n_predict"] == params["max_tokens"] == 99 and params["seed"] == 7
    assert props["build_info"] == f"ninfer {build_string()}"
    load = client.get("/v1/load").json()
    assert load["capacity"]["max_admitted_requests"] == 2 + 16
    assert load["capacity"]["kv_capacity_pages"] == 128 and load["capacity"]["kv_capacity_tokens"] == 8192
    assert load["requests"]["admitted"] == 0
    index = client.get("/v1").json()
    assert {"method": "POST", "path": "/v1/chat/completions", "protocol": "openai_chat"} in index["endpoints"]
    assert index["model"] == "test-model"


def _protocol_module(name: str, path: str, method: str = "GET"):
    """An outside protocol plugin module, registered the way any third-party one would be."""
    mod = types.ModuleType(name)

    class Echo:
        def mount(self, router, ctx):
            async def echo():
                return {"echo": ctx.model.id}

            router.add_api_route(path, echo, methods=[method])

    mod.PROTOCOL = Echo()

    @hookimpl
    def ninfer_register_protocols(register):
        register(name, f"{name}:PROTOCOL")

    mod.ninfer_register_protocols = ninfer_register_protocols
    sys.modules[name] = mod
    return name


BUILTINS = [("ops", "ninfer_core.protocols.ops"), ("openai_chat", "ninfer_core.protocols.openai_chat")]


def test_outside_protocol_is_mounted_like_a_builtin(make_app):
    mod = _protocol_module("_ninfer_test_echo", "/v1/echo")
    client, _, _ = make_app(builtins=BUILTINS + [("echo", mod)], api_key="k")
    r = client.get("/v1/echo", headers={"x-api-key": "k"})
    assert r.json() == {"echo": "test-model"} and r.headers["x-request-id"].startswith("req_")
    assert client.get("/v1/v1/echo", headers={"x-api-key": "k"}).json() == {"echo": "test-model"}
    assert client.get("/v1/echo").status_code == 401


def test_two_protocols_on_one_route_fail_at_startup(make_app):
    from ninfer_core.plugins import PluginError

    mod = _protocol_module("_ninfer_test_dup", "/v1/chat/completions", "POST")
    with pytest.raises(PluginError, match=r"both mount POST /v1/chat/completions"):
        make_app(builtins=BUILTINS + [("dup", mod)])
    other = _protocol_module("_ninfer_test_get_chat", "/v1/chat/completions", "GET")
    client, _, _ = make_app(builtins=BUILTINS + [("get_chat", other)])  # another method is no clash
    assert client.get("/v1/chat/completions").status_code == 200


def test_builtins_can_be_blocked(make_app):
    client, _, _ = make_app(builtins=[("ops", "ninfer_core.protocols.ops")])
    assert client.get("/v1/models").status_code == 200
    _check_envelope(client.post("/v1/chat/completions", json=HI), 404, "not_found")


def test_ingress_bound():
    from ninfer_core.engine.api import EngineError
    from ninfer_core.server.context import Ingress

    ing = Ingress(2)
    ing.acquire()
    ing.acquire()
    with pytest.raises(EngineError) as e:
        ing.acquire()
    assert (e.value.status, e.value.code, e.value.type) == (429, "server_overloaded", "server_overloaded")
    ing.release()
    ing.acquire()
    assert ing.peak == 2
