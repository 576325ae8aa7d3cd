"""The per-type keyword checks of the schema subset (strings, numbers, arrays, objects), mixed into
schema_check's walker; each refuses with a SchemaError naming its path (spec "Structured output")."""

from __future__ import annotations

import math
from decimal import Decimal

from ninfer_core.structured.errors import invalid, unsupported
from ninfer_core.structured.schema_regex import FORMAT_PATTERNS, rewrite_pattern

MAX_SAFE = 2**53 - 1
INT32 = 2**31 - 1
FRACTION_DIGITS = 6  # bounded numbers are generated in decimal notation with at most this many
MAX_DEPTH = 64
OBJECT_KW = {"properties", "required", "additionalProperties", "maxProperties"}
ARRAY_KW = {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"}
STRING_KW = {"minLength", "maxLength", "pattern", "format"}


def count(node: dict, key: str, path: tuple) -> int | None:
    v = node.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > INT32:
        raise invalid(f"'{key}' must be a non-negative integer that fits 32 bits", path + (key,))
    return v


class KeywordChecks:
    """Needs `self.schema(node, path, depth, bool_false_ok)`, `self.resolve(ref, path)`, `self.strict`
    and `self._required(node, path)` from the walker."""

    def _strings(self, node: dict, out: dict, types: list[str] | None, path: tuple) -> None:
        lo, hi = count(node, "minLength", path), count(node, "maxLength", path)
        if lo is not None and hi is not None and lo > hi:
            raise unsupported(
                "minLength", path + ("minLength",), "minLength above maxLength admits no string"
            )
        fmt, pattern = node.get("format"), node.get("pattern")
        for key in ("pattern", "format"):
            if key in node and types != ["string"]:
                raise unsupported(key, path + (key,), f"{key} needs an explicit string type")
        if fmt is not None and pattern is not None:
            raise unsupported("format", path + ("format",), "pattern and format cannot be combined")
        if (fmt is not None or pattern is not None) and (lo is not None or hi is not None):
            key = "format" if fmt is not None else "pattern"
            raise unsupported(key, path + (key,), f"{key} cannot be combined with length bounds")
        if fmt is not None:
            if fmt not in FORMAT_PATTERNS:
                raise unsupported(
                    "format",
                    path + ("format",),
                    f"only date, date-time and time are asserted, got {str(fmt)[:40]!r}",
                )
            out["pattern"] = FORMAT_PATTERNS[fmt]
            out["format"] = fmt  # kept for the semantic plan; the grammar copy drops it
        if pattern is not None:
            if not isinstance(pattern, str):
                raise invalid("'pattern' must be a string", path + ("pattern",))
            out["pattern"] = rewrite_pattern(pattern, path + ("pattern",))
        if lo is not None:
            out["minLength"] = lo
        if hi is not None:
            out["maxLength"] = hi

    def _numbers(self, node: dict, out: dict, types: list[str] | None, path: tuple) -> None:
        present = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node]
        if not present:
            return
        if types not in (["integer"], ["number"]):
            raise unsupported(
                present[0], path + (present[0],), "numeric bounds need an explicit integer or number type"
            )
        integer = types == ["integer"]
        vals = {}
        for k in present:
            v = node[k]
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or abs(v) > MAX_SAFE
            ):
                raise invalid(f"'{k}' must be a finite number within +/-(2^53-1)", path + (k,))
            if integer:
                if not float(v).is_integer():
                    raise unsupported(k, path + (k,), "integer bounds must be whole numbers")
                v = int(v)
            vals[k] = v
            out[k] = v
        if integer:
            lo = max(
                [vals.get("minimum", -MAX_SAFE - 1)]
                + ([vals["exclusiveMinimum"] + 1] if "exclusiveMinimum" in vals else [])
            )
            hi = min(
                [vals.get("maximum", MAX_SAFE + 1)]
                + ([vals["exclusiveMaximum"] - 1] if "exclusiveMaximum" in vals else [])
            )
            empty = lo > hi
        else:
            step = Decimal(1).scaleb(-FRACTION_DIGITS)
            los = [(Decimal(repr(vals["minimum"])), False)] if "minimum" in vals else []
            los += [(Decimal(repr(vals["exclusiveMinimum"])), True)] if "exclusiveMinimum" in vals else []
            his = [(Decimal(repr(vals["maximum"])), False)] if "maximum" in vals else []
            his += [(Decimal(repr(vals["exclusiveMaximum"])), True)] if "exclusiveMaximum" in vals else []
            lo = max((_first_above(v, ex, step) for v, ex in los), default=None)
            hi = min((_last_below(v, ex, step) for v, ex in his), default=None)
            empty = lo is not None and hi is not None and lo > hi
        if empty:
            raise unsupported(present[0], path + (present[0],), "the bounds admit no representable number")

    def _arrays(self, node: dict, out: dict, types: list[str] | None, path: tuple, depth: int) -> None:
        items = node.get("items")
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # draft-07 tuple form
            if prefix is not None:
                raise invalid("'items' as a list cannot stand beside 'prefixItems'", path + ("items",))
            prefix, items = items, None
            if "additionalItems" in node:
                raise unsupported("additionalItems", path + ("additionalItems",))
        if prefix is not None:
            if not isinstance(prefix, list):
                raise invalid("'prefixItems' must be a list of schemas", path + ("prefixItems",))
            out["prefixItems"] = [
                self.schema(s, path + ("prefixItems", i), depth + 1) for i, s in enumerate(prefix)
            ]
        if items is not None:
            out["items"] = self.schema(items, path + ("items",), depth + 1, bool_false_ok=True)
        lo, hi = count(node, "minItems", path), count(node, "maxItems", path)
        if lo is not None and hi is not None and lo > hi:
            raise unsupported("minItems", path + ("minItems",), "minItems above maxItems admits no array")
        if lo is not None:
            out["minItems"] = lo
        if hi is not None:
            out["maxItems"] = hi
        unique = node.get("uniqueItems")
        if unique is not None and not isinstance(unique, bool):
            raise invalid("'uniqueItems' must be a boolean", path + ("uniqueItems",))
        if unique and not (hi is not None and hi <= 1):
            self._unique_domain(out, path)
            out["uniqueItems"] = True

    def _unique_domain(self, node: dict, path: tuple) -> None:
        """uniqueItems is enforced for unrestricted string items and finite string enums/consts."""
        where = path + ("uniqueItems",)
        if "prefixItems" in node:
            raise unsupported("uniqueItems", where, "unique tuples (prefixItems) are not enforced")
        item = node.get("items", {})
        seen = 0
        while isinstance(item, dict) and "$ref" in item and seen < 32:
            item = self.schema(self.resolve(item["$ref"], path), path + ("items",), MAX_DEPTH - 1)
            seen += 1
        if isinstance(item, dict):
            if "const" in item or "enum" in item:
                values = [item["const"]] if "const" in item else item["enum"]
                if all(isinstance(v, str) for v in values):
                    return
            elif item.get("type") == "string" and not (STRING_KW & item.keys()):
                return
        raise unsupported(
            "uniqueItems",
            where,
            "uniqueness is enforced only for arrays of unrestricted strings "
            "or of a finite set of strings (enum/const), or arrays of at most one item",
        )

    def _objects(self, node: dict, out: dict, types: list[str] | None, path: tuple, depth: int) -> None:
        props = node.get("properties")
        if props is not None:
            if not isinstance(props, dict):
                raise invalid("'properties' must be an object", path + ("properties",))
            out["properties"] = {
                k: self.schema(v, path + ("properties", k), depth + 1) for k, v in props.items()
            }
        if "additionalProperties" in node:
            out["additionalProperties"] = self.schema(
                node["additionalProperties"], path + ("additionalProperties",), depth + 1, bool_false_ok=True
            )
        n = count(node, "maxProperties", path)
        if n is not None:
            out["maxProperties"] = n
        required = self._required(node, path)
        if required is None:
            return
        declared = dict(out.get("properties", {}))
        extra = out.get("additionalProperties", False if self.strict else {})
        for name in required:
            if name in declared:
                continue
            if extra is False:
                raise unsupported(
                    "required",
                    path + ("required",),
                    f"the required property {name[:40]!r} is "
                    "neither declared nor allowed by additionalProperties",
                )
            declared[name] = extra  # an open object's required extra names take the additional value schema
        out["properties"] = declared
        out["required"] = list(required)
        if n is not None and len(required) > n:
            raise unsupported(
                "maxProperties",
                path + ("maxProperties",),
                "more required properties than maxProperties allows",
            )


def _first_above(v: Decimal, exclusive: bool, step: Decimal) -> Decimal:
    q = (v / step).to_integral_value(rounding="ROUND_CEILING") * step
    return q + step if exclusive and q == v else q


def _last_below(v: Decimal, exclusive: bool, step: Decimal) -> Decimal:
    q = (v / step).to_integral_value(rounding="ROUND_FLOOR") * step
    return q - step if exclusive and q == v else q
