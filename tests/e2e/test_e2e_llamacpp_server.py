"""End-to-end, issue 27: the routes, headers and options llama-server's scripts rely on, against the
real `ninfer serve` (tiny random Qwen3.5 artifact): unprefixed OpenAI routes, the chat input-token
count, GET /models, /v1/models aliases and tags, CORS (--cors, --cors-origins), --metrics,
--no-slots, --chat-template NAME, --host LIST and --accept-any-model.

llama.cpp behaviour cited from ggml-org/llama.cpp tools/server: server.cpp (the route table: each
OpenAI route with and without /v1, /chat/completions/input_tokens, GET /models), server-http.cpp
(the pre-routing handler: Access-Control-Allow-Origin is the request's Origin; an OPTIONS request
answers with Access-Control-Allow-Credentials: true, Allow-Methods, Allow-Headers and an empty
body, status 200), server-context.cpp (get_res_model_info: id, aliases, tags; --no-slots: 501
not_supported_error) and README.md (--host "IP addresses to listen on, comma-separated",
--cors-origins, --chat-template's built-in names, --metrics, --slots/--no-slots).
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-qwen35-dense"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def strict(tiny_artifact, tmp_path_factory, launch):
    """Origins limited, slots listing off, any model name served, ChatML, two addresses."""
    s = launch(tiny_artifact, "--cors-origins", "http://allowed.test,localhost", "--no-slots", "--metrics",
               "--accept-any-model", "--chat-template", "chatml", "--host", "127.0.0.1,::1",
               log_dir=tmp_path_factory.mktemp("strict"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_cors(tiny_artifact, tmp_path_factory, launch):
    """--cors (any origin) with model aliases and tags (and llama-server's no-op --jinja)."""
    s = launch(tiny_artifact, "--cors", "--model-id", MODEL, "--alias", "alias-one,alias-two",
               "--tags", "local,test", "--jinja",
               log_dir=tmp_path_factory.mktemp("open"))
    yield s
    s.stop()


def test_unprefixed_openai_routes(live_server):
    """server.cpp registers POST /chat/completions, /responses, /responses/input_tokens, GET /models
    and GET /v1/health beside the other forms; an OpenAI client given the server root as its base URL
    uses them."""
    with openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0, timeout=120) as root, \
            openai.OpenAI(base_url=live_server.api_base, api_key="x", max_retries=0, timeout=120) as v1:
        kw = dict(model=MODEL, messages=HI, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        a, b = root.chat.completions.create(**kw), v1.chat.completions.create(**kw)
        assert a.object == "chat.completion" and a.id != b.id
        assert a.choices[0].message == b.choices[0].message and a.usage.completion_tokens == 4
        assert [m.id for m in root.models.list().data] == [MODEL]
        resp = root.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
        assert resp.object == "response" and resp.usage.output_tokens <= 4
    base = live_server.base_url
    assert httpx.get(base + "/v1/health").json()["status"] == "ok"  # server.cpp: /health and /v1/health
    for path in ("/responses/input_tokens", "/v1/responses/input_tokens"):
        r = httpx.post(base + path, json={"model": MODEL, "input": "Hi"})
        assert r.status_code == 200 and r.json()["object"] == "response.input_tokens"


def test_chat_input_tokens(live_server):
    """README "POST /v1/chat/completions/input_tokens: Token Counting": a chat body in,
    {"object": "response.input_tokens", "input_tokens": N} out, N the prompt tokens the chat request
    would process; also unprefixed."""
    base = live_server.base_url
    body = {"model": MODEL, "messages": HI, "max_tokens": 1}
    used = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"]
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        r = httpx.post(base + path, json=body)
        assert r.status_code == 200 and r.json() == {"object": "response.input_tokens", "input_tokens": used}
    bad = httpx.post(base + "/v1/chat/completions/input_tokens", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert httpx.post(base + "/chat/completions/input_tokens", json=body).status_code == 200


def test_models_catalog_and_aliases(live_server, open_cors):
    """server-context.cpp get_res_model_info: each model object has `aliases` (every name, the model's
    own included) and `tags` (--tags); GET /models lists the single model too, here as the spec's
    catalog entry (status.value "loaded", path) with the /v1/models fields."""
    base = open_cors.base_url
    listed = httpx.get(base + "/v1/models").json()["data"]
    assert [(m["id"], m["aliases"], m["tags"]) for m in listed] == [
        (MODEL, [MODEL, "alias-one", "alias-two"], ["local", "test"])]
    catalog = httpx.get(base + "/models").json()["data"][0]
    assert catalog["status"]["value"] == "loaded" and "serve" in catalog["status"]["args"]
    assert catalog["path"].endswith(".ninfer")
    assert {k: v for k, v in catalog.items() if k not in ("path", "status")} == listed[0]
    assert httpx.get(base + "/v1/models/alias-two").json()["id"] == MODEL
    # an alias is served; another name is not
    r = httpx.post(base + "/v1/chat/completions", json={"model": "alias-one", "messages": HI, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = httpx.post(base + "/completion", json={"model": "gpt-4", "prompt": "x", "n_predict": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    plain = httpx.get(live_server.base_url + "/v1/models").json()["data"][0]
    assert plain["aliases"] == [MODEL] and plain["tags"] == []


def test_cors_reflects_origin_with_credentials(open_cors):
    """server-http.cpp: every response's Access-Control-Allow-Origin is the request's Origin; OPTIONS
    answers 200 with Access-Control-Allow-Credentials: true, the methods and the headers, and no body."""
    base = open_cors.base_url
    pre = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.content == b""
    h = pre.headers
    assert h["access-control-allow-origin"] == "http://app.example"
    assert h["access-control-allow-credentials"] == "true"
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= {m.strip() for m in h["access-control-allow-methods"].split(",")}
    assert {"authorization", "content-type"} <= {x.strip() for x in h["access-control-allow-headers"].split(",")}
    r = httpx.post(base + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1},
                   headers={"Origin": "http://other.example"}, timeout=60)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://other.example"
    assert r.headers["access-control-allow-credentials"] == "true" and "Origin" in r.headers["vary"]
    assert "access-control-allow-origin" not in httpx.get(base + "/health").headers  # no Origin, no CORS


def test_cors_origins_allows_only_the_listed(strict):
    """README --cors-origins: "comma-separated list of allowed origins for CORS", `localhost` reflecting
    the Origin "only if it is localhost". Other origins get no CORS grant: NInfer refuses them with 403
    (a cross-site form POST skips the preflight); the server's own pages are always allowed."""
    base = strict.base_url
    for origin in ("http://allowed.test", "http://localhost:5173", "http://127.0.0.1:3000", base):
        pre = httpx.options(base + "/completion", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin, origin
        r = httpx.post(base + "/completion", json={"prompt": "x", "n_predict": 1}, headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    for req in (lambda h: httpx.options(base + "/completion", headers={**h, "Access-Control-Request-Method": "POST"}),
                lambda h: httpx.post(base + "/completion", json={"prompt": "x", "n_predict": 1}, headers=h)):
        r = req({"Origin": "http://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        err = r.json()["error"]
        assert (err["code"], err["type"]) == ("cors_origin_not_allowed", "permission_error")
    assert httpx.post(base + "/completion", json={"prompt": "x", "n_predict": 1}).status_code == 200


def test_metrics_and_no_slots(strict, open_cors):
    """README: --metrics enables /metrics (always on here, the flag is accepted); --no-slots disables
    GET /slots, which then answers 501 `not_supported_error` (server-context.cpp get_slots), and
    /props reports endpoint_slots false."""
    base = strict.base_url
    assert httpx.get(base + "/metrics").status_code == 200
    r = httpx.get(base + "/slots")
    assert r.status_code == 501
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("not_supported_error", "slots_endpoint_disabled")
    assert httpx.get(base + "/props").json()["endpoint_slots"] is False
    assert httpx.get(open_cors.base_url + "/slots").status_code == 200
    assert httpx.get(open_cors.base_url + "/props").json()["endpoint_slots"] is True


def test_chat_template_by_name(strict, tiny_artifact, tmp_path):
    """README --chat-template: a built-in template name (chatml among them); an unknown name is a
    startup error naming the built-ins; a file still works."""
    prompt = httpx.post(strict.base_url + "/apply-template", json={"messages": HI}).json()["prompt"]
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    r = httpx.post(strict.base_url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bad = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", tiny_artifact, "--port", "0",
                          "--chat-template", "llama9000"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1
    assert "llama9000" in bad.stderr and "chatml" in bad.stderr and "qwen35" in bad.stderr


def test_host_list_listens_on_each(strict):
    """README --host: "IP addresses to listen on, comma-separated": 127.0.0.1,::1 serves both on one port."""
    for base in (f"http://127.0.0.1:{strict.port}", f"http://[::1]:{strict.port}"):
        assert httpx.get(base + "/health").json()["status"] == "ok"
        r = httpx.post(base + "/completion", json={"prompt": "x", "n_predict": 1}, headers={"Origin": base})
        assert r.status_code == 200
    assert f"http://[::1]:{strict.port}" in strict.log()


def test_alias_names_the_model(tiny_artifact, start_server):
    """README: "By default, model id field is the path to model file ... You can set a custom value for
    model id field via --alias argument"; the other aliases are further names."""
    s = start_server("--alias", "gpt-4o-mini,mini")
    model = httpx.get(s.base_url + "/v1/models").json()["data"][0]
    assert (model["id"], model["aliases"]) == ("gpt-4o-mini", ["gpt-4o-mini", "mini"])
    r = httpx.post(s.base_url + "/completion", json={"model": "mini", "prompt": "x", "n_predict": 1})
    assert r.status_code == 200 and r.json()["model"] == "gpt-4o-mini"


def test_accept_any_model(strict):
    """llama-server serves every model name with its one model (README: the OpenAI examples send
    "gpt-3.5-turbo", "davinci-002", "gpt-4.1"); --accept-any-model does so on every protocol."""
    with openai.OpenAI(base_url=strict.api_base, api_key="x", max_retries=0, timeout=120) as client:
        chat = client.chat.completions.create(model="gpt-3.5-turbo", messages=HI, max_tokens=2)
        assert chat.model == MODEL
        legacy = client.completions.create(model="davinci-002", prompt="x", max_tokens=2)
        assert legacy.model == MODEL
        resp = client.responses.create(model="gpt-4.1", input="Hi", max_output_tokens=2)
        assert resp.model == MODEL
        assert client.models.retrieve("gpt-4o-mini").id == MODEL
    r = httpx.post(strict.base_url + "/completion", json={"model": "anything", "prompt": "x", "n_predict": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL
