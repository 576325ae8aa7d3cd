"""The structured-output test corpus: schemas across the supported subset (issue 17: at least 50).

Nested objects, arrays, enums, anyOf, local references (recursive ones included), the asserted
formats, patterns, numeric and length bounds, uniqueItems, const, tuples, open objects. Every
schema is within the subset (tests/test_structured_schema.py covers the rejections); most bound
their strings and arrays so that a random-weight model, which would otherwise ramble inside a
string, can finish a document within a small output budget.
"""

from __future__ import annotations

S8 = {"type": "string", "maxLength": 8}
S4 = {"type": "string", "minLength": 1, "maxLength": 4}
INT = {"type": "integer", "minimum": 0, "maximum": 99}
NUM = {"type": "number", "minimum": -5, "maximum": 5}
BOOL = {"type": "boolean"}


def obj(props: dict, required=None, **kw) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    out.update(kw)
    return out


CORPUS: list[dict] = [
    # 0-9: flat objects
    obj({"name": S8, "age": INT}, additionalProperties=False),
    obj({"city": S8, "temperature": NUM}, additionalProperties=False),
    obj({"ok": BOOL}),
    obj({"count": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}}),
    obj({"a": S4, "b": S4, "c": S4}),
    obj({"flag": {"type": ["boolean", "null"]}}),
    obj({"id": {"type": "integer", "minimum": -10, "exclusiveMaximum": 10}, "label": S8}, required=["id"]),
    obj({"nothing": {"type": "null"}}),
    obj({"x": {"const": 3}, "y": {"const": "fixed"}}),
    # 10-19: enums and const
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}),
    {"enum": ["yes", "no", "maybe"]},
    {"enum": [1, 2, 3, True, None]},
    {"const": {"kind": "fixed", "n": [1, 2]}},
    obj({"mode": {"enum": ["a", "b"], "const": "a"}}),
    obj({"level": {"type": "integer", "enum": [1, 5, 10]}}),
    obj({"pair": {"type": "array", "prefixItems": [{"enum": ["k"]}, INT], "items": False}}),
    obj({"unit": {"enum": ["C", "F"]}, "value": NUM}),
    {"type": "boolean"},
    # 20-29: arrays
    {"type": "array", "items": INT, "maxItems": 3},
    {"type": "array", "items": S4, "minItems": 1, "maxItems": 2},
    obj({"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 3}}),
    obj({"picks": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}}),
    {"type": "array", "items": obj({"k": S4, "v": INT}), "maxItems": 2},
    {"type": "array", "prefixItems": [S4, INT, BOOL], "items": False},
    obj(
        {"matrix": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}}
    ),
    obj({"one": {"type": "array", "items": {"type": "integer"}, "maxItems": 1, "uniqueItems": True}}),
    {"type": "array", "items": {"const": "z"}, "uniqueItems": True},
    obj({"empty": {"type": "array", "maxItems": 0}}),
    # 30-39: nesting and references
    obj(
        {
            "person": obj(
                {"name": S8, "address": obj({"city": S8, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}
            )
        }
    ),
    {
        "$defs": {"pt": obj({"x": INT, "y": INT})},
        **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },
    {"definitions": {"name": S8}, **obj({"first": {"$ref": "#/definitions/name"}})},
    {
        "$defs": {
            "node": obj(
                {"v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}},
                required=["v"],
            )
        },
        "$ref": "#/$defs/node",
    },
    obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 3}, "beta": BOOL})}),
    {"$ref": "#/$defs/x", "$defs": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}},
    obj(
        {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
        **{"$defs": {"item": obj({"sku": S4, "qty": INT})}},
    ),
    obj(
        {
            "inner": {
                "type": "object",
                "properties": {"z": S4},
                "additionalProperties": False,
                "required": ["z"],
            }
        }
    ),
    {"title": "Weather", "description": "a report", **obj({"city": {**S8, "description": "where"}})},
    obj({"deep": obj({"deeper": obj({"deepest": BOOL})})}),
    # 40-49: anyOf, formats, patterns, open objects
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    obj({"value": {"anyOf": [S4, {"type": "null"}]}}),
    {
        "type": "object",
        "required": ["kind"],
        "anyOf": [obj({"kind": {"const": "a"}, "n": INT}), obj({"kind": {"const": "b"}, "s": S4})],
    },
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"at": {"type": "string", "format": "date-time"}}),
    obj({"clock": {"type": "string", "format": "time"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"hex": {"type": "string", "pattern": "^(0x)?[0-9a-f]{2,4}$"}}),
    {
        "type": "object",
        "properties": {"name": S4},
        "required": ["name"],
        "additionalProperties": INT,
        "maxProperties": 2,
    },
    obj({"w": S4}, additionalProperties={"type": "boolean"}, maxProperties=2),
    # 50-55: more shapes
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "integer", "minimum": 100, "maximum": 120},
    {"type": "number", "minimum": 0.25, "maximum": 0.75},
    obj({"when": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]}}),
    {
        "type": "object",
        "required": ["req"],
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 1,
    },
    obj({"list": {"type": "array", "items": {"anyOf": [INT, {"type": "null"}]}, "maxItems": 2}}),
]

STRICT = {0, 1, 37}  # checked with strict: true where the protocol has the flag
