"""Test data shared by the structured-output tests: varied JSON schemas (nested objects, arrays,
enums, anyOf, required and optional fields, string formats and patterns, number bounds), each
with a prompt that invites it. Strings are bounded (maxLength, enums, patterns) so that even the
135M model finishes well within the tests' max_tokens."""
from __future__ import annotations

import json

import jsonschema

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: list[tuple[str, dict]] = [
    ("A person as JSON:", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                           "required": ["name", "age"]}),
    ("A city:", {"type": "object", "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1}},
                 "required": ["city"]}),
    ("A color:", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("Is it true?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("A score:", {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
                  "required": ["score"]}),
    ("Three numbers:", {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 3, "maxItems": 3}),
    ("Tags:", {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4}),
    ("A point:", {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["x", "y"], "additionalProperties": False}),
    ("A book:", {"type": "object", "properties": {"title": NAME, "author": {"type": "object", "properties": {"name": NAME},
                                                                            "required": ["name"]}},
                 "required": ["title", "author"]}),
    ("An order:", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                    "items": {"type": "array", "maxItems": 2, "items": {
                                                        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                                                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                                        "required": ["sku", "qty"]}}},
                   "required": ["id", "items"]}),
    ("A phone:", {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                  "required": ["phone"]}),
    ("A status:", {"type": "object", "properties": {"status": {"anyOf": [{"type": "integer", "minimum": 100, "maximum": 599},
                                                                         {"enum": ["ok", "error"]}]}},
                   "required": ["status"]}),
    ("A value:", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}),
    ("A user:", {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
                 "required": ["email"]}),
    ("A date:", {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]}),
    ("An id:", {"type": "object", "properties": {"uuid": {"type": "string", "format": "uuid"}}, "required": ["uuid"]}),
    ("A server:", {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"},
                                                    "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                   "required": ["ip", "port"]}),
    ("Optional fields:", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                           "b": NAME, "c": {"type": "boolean"}},
                          "required": ["a"]}),
    ("A matrix:", {"type": "array", "minItems": 2, "maxItems": 2,
                   "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("A temperature:", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 50},
                                                         "unit": {"const": "C"}},
                        "required": ["celsius", "unit"]}),
    ("A product:", {"type": "object", "properties": {"name": NAME, "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                                     "in_stock": {"type": "boolean"}},
                    "required": ["name", "price", "in_stock"]}),
    ("Nested:", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]}),
    ("A weekday:", {"enum": ["mon", "tue", "wed", "thu", "fri"]}),
    ("A count:", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("A word:", {"type": "string", "pattern": "^[a-z]{2,8}$"}),
    ("Null or number:", {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}},
                         "required": ["v"]}),
    ("A pet:", {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": NAME,
                                                 "vaccinated": {"type": "boolean"}},
                "required": ["kind", "name"], "additionalProperties": False}),
    ("Coordinates:", {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                       "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                      "required": ["lat", "lon"]}),
    ("A team:", {"type": "object", "properties": {"members": {"type": "array", "minItems": 1, "maxItems": 3, "items": NAME}},
                 "required": ["members"]}),
    ("A shape:", {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["circle"]},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["square"]}]}),
    ("A version:", {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}},
                    "required": ["version"]}),
    ("A rating:", {"type": "object", "properties": {"stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
                                                    "comment": {"type": "string", "maxLength": 16}},
                   "required": ["stars"]}),
    ("Refs:", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}},
               "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
               "required": ["start", "end"]}),
]

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{1,12}\.", r"[A-Z][a-z]{2,6} [0-9]{1,2}"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"]]


def check_json(text: str, schema: dict) -> None:
    """Parses and validates (formats included); raises with the text on failure."""
    value = json.loads(text)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    errors = list(validator.iter_errors(value))
    assert not errors, f"{text!r}: {errors[0].message}"
