"""Built-in protocol plugin: rerank, POST /v1/rerank (also /rerank, /v1/reranking, /reranking).

The served chat model judges each document in the reranker formulation of instruction-tuned chat
models: a system turn asks whether the document meets the requirements of the instruction and the
query, answered only "yes" or "no"; the user turn holds the three; the assistant turn opens with
reasoning closed. The turns are written in the model's own markup, `ChatFormat.judge` of its
family (a format without one cannot rerank: 500 rerank_not_supported). The engine
scores the first answer position (GenerationRequest.score_token_ids, nothing generated) and the
document's relevance_score is P(yes) / (P(yes) + P(no)), "Yes" and "No" counted with them.

The Jina / llama.cpp shape answers {"results": [{index, relevance_score, document}], "usage"};
a request with `texts` instead of `documents` follows TEI: a bare list of {index, score[, text]}.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.protocols import wire_schemas
from ninfer_core.protocols.raw_prompt import WireModel, check_model
from ninfer_core.protocols.raw_submit import cancelled_error, unfinished_error
from ninfer_core.protocols.wire_schemas import described
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request, parse_json_body
from ninfer_core.server.sse import ClientDisconnected, unless_disconnected
from ninfer_core.tokenizer.chat_format import chat_format_of

MAX_DOCUMENTS = 1000
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct '
                'provided. Note that the answer can only be "yes" or "no".')
YES_WORDS = ("yes", "Yes")
NO_WORDS = ("no", "No")


class RerankRequest(WireModel):
    model: described(wire_schemas.OPTIONAL_STRING) = None
    query: described(wire_schemas.OPTIONAL_STRING) = None
    documents: described(wire_schemas.STRINGS) = None
    texts: described(wire_schemas.STRINGS) = None  # TEI
    top_n: int | None = None
    return_documents: bool | None = None
    return_text: bool | None = None  # TEI
    raw_scores: bool | None = None  # TEI: the log-odds ln P(yes) - ln P(no) instead of the probability
    truncate: bool | None = None  # TEI: accepted; a document that does not fit fails the request
    instruction: str | None = None


@dataclass
class RerankPlan:
    query: str
    documents: list[str]
    instruction: str
    top_n: int
    return_documents: bool
    tei: bool
    raw_scores: bool


def _texts(items: Any, param: str, tei: bool) -> list[str]:
    if not isinstance(items, list):
        raise bad_request("invalid_type", f"{param} must be a list.", param)
    if not items:
        raise bad_request("invalid_value", f"{param} must hold at least one document.", param)
    if len(items) > MAX_DOCUMENTS:
        raise bad_request("invalid_value", f"{param} holds {len(items)} documents; at most {MAX_DOCUMENTS} "
                          "are ranked per request.", param)
    out = []
    for i, d in enumerate(items):
        if isinstance(d, str):
            out.append(d)
        elif isinstance(d, dict) and not tei:
            text = d.get("text")
            if not isinstance(text, str):
                raise bad_request("invalid_type" if "text" in d else "missing_required_parameter",
                                  "a document object needs a string 'text'.", f"{param}.{i}.text")
            out.append(text)
        else:
            kind = "strings" if tei else "strings or {\"text\": ...} objects"
            raise bad_request("invalid_type", f"{param} must be {kind}.", f"{param}.{i}")
    return out


def validate_body(raw: bytes, ctx: ServerContext) -> RerankPlan:
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    req = RerankRequest.model_validate(data)
    check_model(req.model, ctx)
    if req.query is None:
        raise bad_request("missing_required_parameter", "Missing required parameter: 'query'.", "query")
    if not isinstance(req.query, str):
        raise bad_request("invalid_type", "query must be a string.", "query")
    if req.documents is not None and req.texts is not None:
        raise bad_request("invalid_value", "Send either documents or texts (TEI), not both.", "texts")
    tei = req.documents is None and req.texts is not None
    if req.documents is None and req.texts is None:
        raise bad_request("missing_required_parameter", "Missing required parameter: 'documents'.",
                          "documents")
    docs = _texts(req.texts if tei else req.documents, "texts" if tei else "documents", tei)
    if req.top_n is not None and req.top_n < 1:
        raise bad_request("invalid_value", "top_n must be a positive integer.", "top_n")
    instruction = DEFAULT_INSTRUCTION if req.instruction is None else req.instruction
    return RerankPlan(query=req.query, documents=docs, instruction=instruction,
                      top_n=min(req.top_n or len(docs), len(docs)),
                      return_documents=bool(req.return_text) if tei else req.return_documents is not False,
                      tei=tei, raw_scores=bool(req.raw_scores))


class Judge:
    """Builds judging prompts as token ids: the markup as control tokens, the caller's text as text,
    so a query or document quoting a turn's end marker cannot close a turn."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.yes_ids = _word_ids(tokenizer, YES_WORDS)
        self.no_ids = _word_ids(tokenizer, NO_WORDS)
        if not self.yes_ids or not self.no_ids:
            raise EngineError(500, "rerank_not_supported", "The model's tokenizer has no single 'yes'/'no' "
                              "token to judge relevance with.", type_="server_error")
        judge = chat_format_of(tokenizer).judge
        if judge is None:
            raise EngineError(500, "rerank_not_supported", "The model's chat format states no judging "
                              "prompt to rerank with.", type_="server_error")
        self._head = self._markup(judge.head.format(system=JUDGE_SYSTEM))
        self._tail = self._markup(judge.tail)

    def _markup(self, text: str) -> list[int]:
        return self.tok.encode(text, allow_special=True)

    def shared(self, instruction: str, query: str) -> list[int]:
        """The judging prefix every document of one request shares (the context cache keeps it)."""
        return self._head + self.tok.encode(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>:",
                                            allow_special=False)

    def prompt(self, instruction: str, query: str, document: str,
               shared: list[int] | None = None) -> list[int]:
        # ":" and the space-led first word are separate pre-tokens, so encoding the document on its
        # own after the shared prefix gives the ids the whole text would have
        head = shared if shared is not None else self.shared(instruction, query)
        return head + self.tok.encode(" " + document, allow_special=False) + self._tail

    @property
    def score_ids(self) -> list[int]:
        return self.yes_ids + self.no_ids

    def log_odds(self, scores: list[float]) -> float:
        """ln P(yes-words) - ln P(no-words) from the engine's log-probabilities of `score_ids`."""
        k = len(self.yes_ids)
        return _logsumexp(scores[:k]) - _logsumexp(scores[k:])


def _word_ids(tok: Any, words: tuple[str, ...]) -> list[int]:
    ids = []
    for w in words:
        tid = tok.token_to_id(w)
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return -math.inf
    return m + math.log(sum(math.exp(x - m) for x in xs))


def relevance(log_odds: float) -> float:
    """P(yes) / (P(yes) + P(no)) from ln P(yes) - ln P(no); 0.5 when both are impossible."""
    if math.isnan(log_odds):
        return 0.5
    if log_odds >= 0:
        return 1.0 / (1.0 + math.exp(-log_odds))
    e = math.exp(log_odds)
    return e / (1.0 + e)


class Rerank:
    name = "rerank"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        async def rerank(request: Request) -> Response:
            return await self.handle(request, ctx)

        for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
            router.add_api_route(path, rerank, methods=["POST"])

    async def handle(self, request: Request, ctx: ServerContext) -> Response:
        plan = await anyio.to_thread.run_sync(validate_body, await request.body(), ctx)
        ctx.ingress.acquire()
        try:
            judge = Judge(ctx.tokenizer)
            shared = judge.shared(plan.instruction, plan.query)
            prompts = await anyio.to_thread.run_sync(
                lambda: [judge.prompt(plan.instruction, plan.query, d, shared) for d in plan.documents])
            request_id = request.scope.get("state", {}).get("request_id", "")
            handles: list[Any] = []

            def cancel_all() -> None:
                for h in handles:
                    h.cancel()

            try:
                odds = await unless_disconnected(
                    request, self._judge_all(ctx, judge, prompts, len(shared), request_id, handles,
                                             "texts" if plan.tei else "documents"), cancel_all)
            except ClientDisconnected:
                return Response(status_code=499)
        finally:
            ctx.ingress.release()
        return JSONResponse(self._response(ctx, plan, odds, sum(len(p) for p in prompts)))

    async def _judge_all(self, ctx: ServerContext, judge: Judge, prompts: list[list[int]], shared: int,
                         request_id: str, handles: list[Any], field: str) -> list[float]:
        """Judge every prompt, a lane's worth (--max-concurrency) at a time; the first failure
        cancels the judgements still running and fails the request."""
        lanes = asyncio.Semaphore(max(1, ctx.options.engine.max_concurrency))
        pending_s = ctx.options.engine.pending_timeout_ms / 1000.0
        greedy = SamplingParams(temperature=0.0, greedy=True, seed=0)

        async def one(i: int) -> float:
            async with lanes:
                gen = GenerationRequest(prompt_ids=prompts[i], sampling=greedy, max_tokens=0,
                                        request_id=f"{request_id}-{i}" if request_id else "",
                                        deadline=time.monotonic() + pending_s,
                                        score_token_ids=judge.score_ids,
                                        checkpoint_hints=CheckpointHints(stable_prefix=shared))
                try:
                    handle = ctx.engine.submit(gen)
                except EngineError as e:
                    if e.param in ("messages", "max_tokens"):  # the engine names chat fields
                        e.param = f"{field}.{i}"
                    raise
                handles.append(handle)
                async for ev in handle.events():
                    if ev.kind == "error":
                        raise ev.error
                    if ev.kind == "finish":
                        if ev.finish_reason == "cancelled":
                            raise cancelled_error()
                        if not ev.scores or len(ev.scores) != len(judge.score_ids):
                            raise unfinished_error()
                        return judge.log_odds(ev.scores)
                raise unfinished_error()

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            for h in handles:
                h.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _response(self, ctx: ServerContext, plan: RerankPlan, odds: list[float], prompt_tokens: int) -> Any:
        scores = [relevance(x) for x in odds]
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: plan.top_n]
        if plan.tei:
            out = []
            for i in order:
                score = _finite(odds[i]) if plan.raw_scores else scores[i]
                item: dict[str, Any] = {"index": i, "score": score}
                if plan.return_documents:
                    item["text"] = plan.documents[i]
                out.append(item)
            return out
        results = []
        for i in order:
            item = {"index": i, "relevance_score": scores[i]}
            if plan.return_documents:
                item["document"] = {"text": plan.documents[i]}
            results.append(item)
        return {"object": "list", "model": ctx.model.id, "results": results,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _finite(x: float) -> float:
    """JSON has no infinity: a certain judgement reports a large finite log-odds instead."""
    return x if math.isfinite(x) else math.copysign(1e4, x)


PROTOCOL = Rerank()


@hookimpl
def ninfer_register_protocols(register):
    register("rerank", "ninfer_core.protocols.rerank:PROTOCOL")
