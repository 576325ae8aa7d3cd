"""schemathesis hooks of scripts/fuzz_openapi.py (loaded through SCHEMATHESIS_HOOKS=fuzz_hooks).

A fuzzed output limit (max_tokens, n_predict, ...) is capped at OUTPUT_CAP tokens before the
request is sent, so a CPU run generates a bounded amount; the field itself is still fuzzed (its
types, its negative and huge values rejected or accepted as before the cap applies to positive
ints only). Nothing else of a case is changed. A "no limit" value (-1) still generates up to the
fuzzed server's short --max-context; on a loaded CPU that takes minutes, hence the generous
--request-timeout of scripts/fuzz_openapi.py.
"""

from __future__ import annotations

import schemathesis

OUTPUT_CAP = 8
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    body = case.body
    if isinstance(body, dict):
        for key in LIMIT_FIELDS:
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > OUTPUT_CAP:
                body[key] = OUTPUT_CAP
