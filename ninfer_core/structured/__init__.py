"""Structured output (spec "Structured output"): JSON and JSON Schema response formats, llama.cpp
grammars and schema-constrained forced tool calls, enforced token by token with xgrammar.

- formats: the protocols' response-format fields -> ResponseFormat; the --structured-output gate
- schema_check, schema_regex: the supported JSON Schema subset and its rejections
- compiler: StructuredOutput, the per-model xgrammar service (tokenizer info, compiler, cache)
- constraint: Constraint, the per-request object the engine drives (fill_next_mask/accept/rollback)
- tracker, vocab: the semantic checks beside the grammar (lengths, uniqueItems, aliases, surrogates)
- masks: MaskStage, the engine's host-thread mask stage
- request: the protocol-side helper that turns a format into a GenerationRequest constraint
"""
