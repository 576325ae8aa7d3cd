"""The server's structured-output service: xgrammar's tokenizer info and compiler for one model.

`StructuredOutput(tokenizer, vocab_size)` is built once when the model loads (--structured-output).
`compile(fmt, tools=..., forced_parameters=...)` checks and compiles a request's format (host work:
call it on a worker thread; results are cached by the complete serialised format, declaration order
included), and `constraint(compiled, ...)` makes the per-request object the engine drives.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgrammar as xgr

from ninfer_core.engine.api import EngineError
from ninfer_core.structured.constraint import Constraint
from ninfer_core.structured.errors import SchemaError
from ninfer_core.structured.formats import ResponseFormat
from ninfer_core.structured.schema_check import grammar_copy, prepare_schema
from ninfer_core.structured.tools import auto_calls, forced_call_rest
from ninfer_core.structured.tracker import Plan
from ninfer_core.structured.vocab import VocabTables

log = logging.getLogger("ninfer.structured")

MAX_WHITESPACE = 8  # spec: whitespace between JSON elements is bounded to eight characters per run
CACHE_ENTRIES = 128


@dataclass
class CompiledFormat:
    grammar: Any  # xgrammar.CompiledGrammar
    plan: Plan | None  # the semantic layer's schema (JSON content only)
    close_words: np.ndarray  # the format newlines after a reasoning close
    with_tools: bool = False
    kind: str = "json_schema"


class StructuredOutput:
    def __init__(self, tokenizer, vocab_size: int, threads: int = 2):
        self.vocab = VocabTables(tokenizer, vocab_size)
        self.info = xgr.TokenizerInfo(
            self.vocab.token_bytes,
            xgr.VocabType.RAW,
            vocab_size=self.vocab.size,
            stop_token_ids=list(self.vocab.eos_ids) or None,
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=256 << 20)
        self.close_words = self.vocab.close_whitespace_words()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Build the static token tables now (about a second for a 248k vocabulary), not on a request."""
        _ = self.vocab.tables

    # -- compiling -----------------------------------------------------------------------------
    def compile(
        self,
        fmt: ResponseFormat | None,
        *,
        tools: list[dict] | None = None,
        parallel: bool = True,
        forced_parameters: Any = None,
        forced_param: str = "tools",
    ) -> CompiledFormat:
        """The compiled constraint for a request; EngineError 400 naming the field on a bad schema."""
        key = json.dumps([fmt.__dict__ if fmt else None, tools, parallel, forced_parameters], default=str)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if forced_parameters is not None:
            compiled = self._forced(forced_parameters, forced_param)
        else:
            compiled = self._format(fmt, tools, parallel)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _format(self, fmt: ResponseFormat, tools: list[dict] | None, parallel: bool) -> CompiledFormat:
        if fmt.kind == "grammar":
            try:
                grammar = xgr.Grammar.from_ebnf(fmt.grammar)
                compiled = self.compiler.compile_grammar(grammar)
            except Exception as e:  # noqa: BLE001 - xgrammar reports parse errors as RuntimeError
                raise EngineError(
                    400,
                    "invalid_grammar",
                    f"The GBNF grammar does not parse: {_first_line(e)}",
                    param=fmt.param,
                ) from None
            return CompiledFormat(compiled, None, self.close_words, kind="grammar")
        if fmt.kind == "json_object":
            schema, strict, any_of = {"type": "object"}, False, False
        else:
            try:
                schema, any_of = prepare_schema(fmt.schema, fmt.strict)
            except SchemaError as e:
                raise e.to_engine_error(fmt.schema_param or fmt.param) from None
            strict = fmt.strict
        # In a schema without anyOf the string length bounds are enforced beside the grammar.
        grammar_schema = grammar_copy(schema, strip_lengths=not any_of)
        text = json.dumps(grammar_schema, ensure_ascii=False)
        try:
            json_grammar = xgr.Grammar.from_json_schema(
                text, any_whitespace=True, strict_mode=strict, max_whitespace_cnt=MAX_WHITESPACE
            )
            if tools:
                calls = xgr.Grammar.from_structural_tag(auto_calls(tools, parallel))
                json_grammar = xgr.Grammar.union(json_grammar, calls)
            compiled = self.compiler.compile_grammar(json_grammar)
        except Exception as e:  # noqa: BLE001 - a schema xgrammar cannot compile is the client's
            raise EngineError(
                400,
                "invalid_json_schema",
                f"The schema cannot be compiled: {_first_line(e)}",
                param=fmt.schema_param or fmt.param,
            ) from None
        plan = Plan(schema, strict)
        return CompiledFormat(compiled, plan, self.close_words, with_tools=bool(tools), kind=fmt.kind)

    def _forced(self, parameters: Any, param: str) -> CompiledFormat:
        try:
            schema, _ = prepare_schema(parameters if parameters is not None else {}, False)
        except SchemaError as e:
            raise e.to_engine_error(param) from None
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise EngineError(
                400, "invalid_json_schema", "A tool's parameters must describe an object.", param=param
            )
        try:
            tag = forced_call_rest(grammar_copy(schema, False))
        except SchemaError as e:
            raise e.to_engine_error(param) from None
        try:
            compiled = self.compiler.compile_structural_tag(tag)
        except Exception as e:  # noqa: BLE001
            raise EngineError(
                400,
                "invalid_json_schema",
                f"The tool's parameter schema cannot be compiled: {_first_line(e)}",
                param=param,
            ) from None
        return CompiledFormat(compiled, None, self.close_words, kind="forced_call")

    # -- per request ---------------------------------------------------------------------------
    def constraint(
        self, compiled: CompiledFormat, *, in_reasoning: bool = False, think_end_ids=()
    ) -> Constraint:
        return Constraint(compiled, self.vocab, in_reasoning=in_reasoning, think_end_ids=think_end_ids)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = text[-1] if text else type(e).__name__
    return line[:300]
