"""The supported JSON Schema subset (spec "Structured output"): checks, rejections, normalisation.

`prepare_schema(schema, strict)` walks the schema once, refuses every keyword outside the subset
with a SchemaError naming its path, and returns the normalised schema: formats become patterns,
patterns are rewritten for xgrammar (schema_regex), const/enum intersections are reduced, common
type/required assertions beside anyOf are distributed into the branches, required names that only
additionalProperties can supply become declared properties, and keyword-implied types are made
explicit (generating a subset of what the schema allows). xgrammar 0.2.9 silently ignores many
keywords (multipleOf, oneOf, not, uniqueItems, ...), so nothing reaches it unchecked.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.structured.errors import SchemaError, invalid, unsupported
from ninfer_core.structured.schema_keywords import ARRAY_KW, MAX_DEPTH, OBJECT_KW, STRING_KW, KeywordChecks

ANNOTATIONS = {"$schema", "title", "description", "default", "examples", "$comment"}
TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
SCHEMA_URIS = {"https://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft-07/schema"}

NUMBER_KW = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
STRUCTURE_KW = {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "$id"}
SUPPORTED = ANNOTATIONS | OBJECT_KW | ARRAY_KW | STRING_KW | NUMBER_KW | STRUCTURE_KW
# Keywords users send that the subset leaves out, with the reason named in the error.
REJECTED = {
    "multipleOf": "multiples are not enforced",
    "oneOf": "use anyOf",
    "allOf": "merge the subschemas",
    "not": "negation is not enforced",
    "if": "conditionals are not enforced",
    "then": "conditionals are not enforced",
    "else": "conditionals are not enforced",
    "dependentRequired": "dependencies are not enforced",
    "dependentSchemas": "dependencies are not enforced",
    "dependencies": "dependencies are not enforced",
    "patternProperties": "declare the properties",
    "propertyNames": "key constraints are not enforced",
    "minProperties": "only maxProperties is enforced",
    "contains": "contains is not enforced",
    "minContains": "contains is not enforced",
    "maxContains": "contains is not enforced",
    "unevaluatedProperties": "use additionalProperties",
    "unevaluatedItems": "use items",
    "additionalItems": "use items",
    "$dynamicRef": "only local $ref is supported",
    "$recursiveRef": "only local $ref is supported",
    "$anchor": "only JSON-pointer $ref is supported",
    "$dynamicAnchor": "only JSON-pointer $ref is supported",
    "$recursiveAnchor": "only local $ref is supported",
    "$vocabulary": "vocabularies are not supported",
    "contentEncoding": "content keywords are not enforced",
    "contentMediaType": "content keywords are not enforced",
    "contentSchema": "content keywords are not enforced",
}


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def json_equal(a: Any, b: Any) -> bool:
    """JSON value equality: key order ignored, array order kept, 1 == 1.0, true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _types(node: dict, path: tuple) -> list[str] | None:
    t = node.get("type")
    if t is None:
        return None
    items = [t] if isinstance(t, str) else t
    if not isinstance(items, list) or not items or any(not isinstance(x, str) for x in items):
        raise invalid("'type' must be a type name or a non-empty list of them", path + ("type",))
    for x in items:
        if x not in TYPES:
            raise invalid(f"unknown type {x!r}", path + ("type",))
    if len(set(items)) != len(items):
        raise invalid("'type' lists a type twice", path + ("type",))
    return items


class _Walker(KeywordChecks):
    def __init__(self, root: Any, strict: bool):
        self.root, self.strict = root, strict
        self.has_any_of = False

    # -- references --------------------------------------------------------------------------
    def resolve(self, ref: Any, path: tuple) -> Any:
        if not isinstance(ref, str):
            raise invalid("'$ref' must be a string", path)
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise unsupported(
                "$ref", path, f"only local references (# or #/path) are supported, got {ref[:80]!r}"
            )
        segments = ref[2:].split("/")
        if any(not seg or "~" in seg or "%" in seg for seg in segments):
            raise unsupported("$ref", path, "escaped or empty path segments are not supported")
        node = self.root
        for seg in segments:
            if isinstance(node, dict) and seg in node:
                node = node[seg]
            elif isinstance(node, list) and seg.isdigit() and int(seg) < len(node):
                node = node[int(seg)]
            else:
                raise invalid(f"'$ref' {ref[:80]!r} names nothing in this schema", path)
        if not isinstance(node, (dict, bool)):
            raise invalid(f"'$ref' {ref[:80]!r} does not name a schema", path)
        return node

    # -- the walk ----------------------------------------------------------------------------
    def schema(self, node: Any, path: tuple, depth: int = 0, bool_false_ok: bool = False) -> Any:
        if depth > MAX_DEPTH:
            raise invalid(f"the schema is nested deeper than {MAX_DEPTH} levels", path)
        if node is True:
            return {}
        if node is False:
            if bool_false_ok:
                return False
            raise unsupported("false", path, "a false schema admits no value")
        if not isinstance(node, dict):
            raise invalid("a schema must be an object or a boolean", path)
        for key in node:
            if key in REJECTED:
                raise unsupported(key, path + (key,), REJECTED[key])
            if key not in SUPPORTED:
                raise unsupported(key, path + (key,))
        self._annotations(node, path)
        out: dict = {k: v for k, v in node.items() if k in ANNOTATIONS}
        for defs in ("$defs", "definitions"):
            if defs in node:
                if not isinstance(node[defs], dict):
                    raise invalid(f"'{defs}' must be an object", path + (defs,))
                out[defs] = {k: self.schema(v, path + (defs, k), depth + 1) for k, v in node[defs].items()}
        rest = {
            k: v for k, v in node.items() if k not in ANNOTATIONS and k not in ("$defs", "definitions", "$id")
        }
        if "$id" in node:
            if not isinstance(node["$id"], str):
                raise invalid("'$id' must be a string", path + ("$id",))
            if _has_ref(node):
                raise unsupported(
                    "$id",
                    path + ("$id",),
                    "a $id whose subtree holds references (scoped "
                    "resolution through resource identifiers is not supported)",
                )
        if "$ref" in rest:
            for key in rest:
                if key != "$ref":
                    raise unsupported(
                        key,
                        path + (key,),
                        "$ref cannot have sibling constraints; move them into the referenced schema",
                    )
            self.resolve(rest["$ref"], path + ("$ref",))
            out["$ref"] = rest["$ref"]
            return out
        if "anyOf" in rest:
            return self._any_of(rest, out, path, depth)
        if "enum" in rest or "const" in rest:
            return self._literal(rest, out, path)
        types = _types(rest, path)
        if types is None:
            types = self._implied_type(rest, path)
        if types is not None:
            out["type"] = types[0] if len(types) == 1 else types
        self._strings(rest, out, types, path)
        self._numbers(rest, out, types, path)
        self._arrays(rest, out, types, path, depth)
        self._objects(rest, out, types, path, depth)
        return out

    def _annotations(self, node: dict, path: tuple) -> None:
        uri = node.get("$schema")
        if uri is not None:
            if (
                not isinstance(uri, str)
                or uri.rstrip("#").replace(
                    "http://json-schema.org/draft/2020-12", "https://json-schema.org/draft/2020-12"
                )
                not in SCHEMA_URIS
            ):
                raise unsupported(
                    "$schema", path + ("$schema",), "only JSON Schema 2020-12 and draft-07 are supported"
                )

    def _implied_type(self, node: dict, path: tuple) -> list[str] | None:
        families = [
            name
            for name, kws in (("object", OBJECT_KW), ("array", ARRAY_KW), ("string", STRING_KW))
            if any(k in node for k in kws)
        ]
        for key in ("pattern", "format"):
            if key in node:
                raise unsupported(key, path + (key,), f"{key} needs an explicit string type")
        numeric = [k for k in NUMBER_KW if k in node]
        if numeric:
            raise unsupported(
                numeric[0], path + (numeric[0],), "numeric bounds need an explicit integer or number type"
            )
        if len(families) > 1:
            raise unsupported(
                "type", path, f"keywords of several types ({', '.join(families)}) without an explicit type"
            )
        return families or None

    def _literal(self, node: dict, out: dict, path: tuple) -> dict:
        values: list
        if "enum" in node:
            values = node["enum"]
            if not isinstance(values, list) or not values:
                raise invalid("'enum' must be a non-empty list", path + ("enum",))
            if "const" in node:
                if not any(json_equal(node["const"], v) for v in values):
                    raise unsupported(
                        "const",
                        path + ("const",),
                        "the constant is not a member of the enum, so no value satisfies both",
                    )
                values = [node["const"]]
        else:
            values = [node["const"]]
        for key in node:
            if key not in ("enum", "const", "type"):
                raise unsupported(key, path + (key,), "const and enum allow only a matching type beside them")
        types = _types(node, path)
        if types is not None:
            for v in values:
                t = json_type(v)
                if t not in types and not (t == "integer" and "number" in types):
                    raise unsupported(
                        "type", path + ("type",), f"the value {str(v)[:40]} is not of the declared type"
                    )
        if len(values) == 1:
            out["const"] = values[0]
        else:
            out["enum"] = values
        return out

    def _any_of(self, node: dict, out: dict, path: tuple, depth: int) -> dict:
        self.has_any_of = True
        branches = node["anyOf"]
        if not isinstance(branches, list) or not branches:
            raise invalid("'anyOf' must be a non-empty list", path + ("anyOf",))
        for key in node:
            if key not in ("anyOf", "type", "required"):
                raise unsupported(
                    key,
                    path + (key,),
                    "only type and required can stand beside anyOf (they are "
                    "distributed into every branch); move it into each branch",
                )
        outer_types = _types(node, path)
        outer_required = self._required(node, path)
        kept = []
        for i, b in enumerate(branches):
            bp = path + ("anyOf", i)
            if (outer_types or outer_required) and isinstance(b, dict) and "$ref" in b:
                raise unsupported(
                    "$ref",
                    bp + ("$ref",),
                    "a referenced anyOf branch cannot take the type or "
                    "required beside anyOf; move them into the referenced schema",
                )
            branch = self.schema(b, bp, depth + 1)
            merged = self._intersect(branch, outer_types, outer_required)
            if merged is not None:
                kept.append(merged)
        if not kept:
            raise unsupported("anyOf", path + ("anyOf",), "no branch is compatible with the type beside it")
        out["anyOf"] = kept
        return out

    @staticmethod
    def _intersect(branch: dict, types: list[str] | None, required: list[str] | None) -> dict | None:
        """A branch with the outer assertions added; None when it provably admits nothing."""
        branch = dict(branch)
        if types is not None:
            if "const" in branch or "enum" in branch:
                values = [branch["const"]] if "const" in branch else branch["enum"]
                values = [
                    v
                    for v in values
                    if json_type(v) in types or (json_type(v) == "integer" and "number" in types)
                ]
                if not values:
                    return None
                branch.pop("enum", None)
                branch.pop("const", None)
                branch["enum" if len(values) > 1 else "const"] = values if len(values) > 1 else values[0]
            elif "anyOf" not in branch and "$ref" not in branch:
                own = branch.get("type")
                own_list = [own] if isinstance(own, str) else (own or list(TYPES))
                both = [t for t in own_list if t in types or (t == "integer" and "number" in types)]
                both += [t for t in types if t == "integer" and "number" in own_list and t not in both]
                if not both:
                    return None
                branch["type"] = both[0] if len(both) == 1 else both
        if required:
            if "anyOf" in branch or "$ref" in branch:
                return branch
            own_types = branch.get("type")
            own_types = [own_types] if isinstance(own_types, str) else own_types
            if own_types is None or "object" in own_types:
                branch["required"] = list(dict.fromkeys(list(branch.get("required", [])) + list(required)))
                props = dict(branch.get("properties", {}))
                for name in required:
                    if name not in props:
                        if branch.get("additionalProperties") is False:
                            return None
                        props[name] = branch.get("additionalProperties") or {}
                if props:
                    branch["properties"] = props
        return branch

    def _required(self, node: dict, path: tuple) -> list[str] | None:
        req = node.get("required")
        if req is None:
            return None
        if not isinstance(req, list) or any(not isinstance(x, str) for x in req):
            raise invalid("'required' must be a list of property names", path + ("required",))
        if len(set(req)) != len(req):
            raise invalid("'required' names a property twice", path + ("required",))
        return req


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(
            _has_ref(v) for k, v in node.items() if k not in ("enum", "const", "default", "examples")
        )
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def prepare_schema(schema: Any, strict: bool) -> tuple[Any, bool]:
    """(the normalised schema, whether it holds an anyOf); raises SchemaError."""
    walker = _Walker(schema, strict)
    if schema is True or schema == {}:
        return {}, False
    out = walker.schema(schema, ())
    return out, walker.has_any_of


def grammar_copy(node: Any, strip_lengths: bool) -> Any:
    """The schema xgrammar compiles: without the keys kept only for the semantic layer (format, and
    the string length bounds when they are enforced beside the grammar)."""
    if isinstance(node, list):
        return [grammar_copy(v, strip_lengths) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "format" or (strip_lengths and k in ("minLength", "maxLength")) or k == "uniqueItems":
            continue
        if k in ("enum", "const", "default", "examples"):
            out[k] = v
        elif k in ("properties", "$defs", "definitions"):
            out[k] = {name: grammar_copy(s, strip_lengths) for name, s in v.items()}
        else:
            out[k] = grammar_copy(v, strip_lengths)
    return out


def schema_error(e: SchemaError, param: str):
    return e.to_engine_error(param)


__all__ = ["SchemaError", "prepare_schema", "grammar_copy", "json_equal", "json_type"]
