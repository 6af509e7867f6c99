"""Structured-output fields of a request, and the one constraint they give the engine.

A request may constrain its output through exactly one of:

* ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (``"text"`` is no constraint);
* vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": ...}``,
  ``{"choice": [...]}``, ``{"grammar": EBNF}`` or ``{"json_object": true}``;
* vLLM's older aliases ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (``guided_decoding_backend`` may only name ``xgrammar`` or ``auto``);
* on chat, ``tool_choice="required"`` or a named function (see
  :func:`pdserve.serving.api.protocol_chat.forced_tool_schema`).

Two of them at once is a 400 naming the second. The spec itself is checked by the input
processor, which builds its grammar in the API server's blocking pool
(:meth:`pdserve.frontend.processor.InputProcessor.check_grammar`): an invalid schema,
regex or grammar is a 400 before the engine sees the request. JSON is generated
compact: one space after ``:`` and ``,``, no other optional whitespace (a model cannot
pad it forever).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pdserve.core_types.sampling_params import StructuredOutputsParams
from pdserve.serving.api.protocol_base import RequestError, StrictModel

_BACKENDS = ("xgrammar", "auto")
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


class ResponseFormat(StrictModel):
    type: str
    json_schema: dict[str, Any] | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs`` request field."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(schema: str | dict[str, Any], param: str) -> str:
    import json

    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError:
            raise RequestError("the JSON schema is not valid JSON", param) from None
        return schema
    return json.dumps(schema, separators=(",", ":"))


def from_response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    param = "response_format"
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type != "json_schema":
        raise RequestError(
            f"response_format type {rf.type!r} is not supported (text, json_object or json_schema)",
            param,
        )
    js = rf.json_schema
    if not isinstance(js, dict) or "schema" not in js:
        raise RequestError("response_format type 'json_schema' needs json_schema.schema", param)
    unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise RequestError(f"unknown json_schema field(s): {', '.join(unknown)}", param)
    return StructuredOutputsParams(json=_schema_text(js["schema"], param))


def from_structured_outputs(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    param = "structured_outputs"
    return StructuredOutputsParams(
        json=_schema_text(so.json_, param) if so.json_ is not None else None,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=list(so.choice) if so.choice is not None else None,
        grammar=so.grammar,
    )


class StructuredFields(StrictModel):
    """The structured-output fields both completions and chat completions take."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def structured_spec(self) -> tuple[StructuredOutputsParams, str] | None:
        """(the request's one constraint, the field it came from), or None."""
        found: list[tuple[StructuredOutputsParams, str]] = []
        if self.response_format is not None:
            spec = from_response_format(self.response_format)
            if spec is not None:
                found.append((spec, "response_format"))
        if self.structured_outputs is not None:
            found.append((from_structured_outputs(self.structured_outputs), "structured_outputs"))
        guided = {
            "guided_json": StructuredOutputsParams(
                json=_schema_text(self.guided_json, "guided_json")
            )
            if self.guided_json is not None
            else None,
            "guided_regex": StructuredOutputsParams(regex=self.guided_regex)
            if self.guided_regex is not None
            else None,
            "guided_choice": StructuredOutputsParams(choice=self.guided_choice)
            if self.guided_choice is not None
            else None,
            "guided_grammar": StructuredOutputsParams(grammar=self.guided_grammar)
            if self.guided_grammar is not None
            else None,
        }
        found.extend((g, name) for name, g in guided.items() if g is not None)
        backend = self.guided_decoding_backend
        if backend is not None and backend.split(":")[0] not in _BACKENDS:
            raise RequestError(
                f"guided_decoding_backend {backend!r} is not available (pdserve uses xgrammar)",
                "guided_decoding_backend",
            )
        return self._one(found)

    @staticmethod
    def _one(
        found: list[tuple[StructuredOutputsParams, str]],
    ) -> tuple[StructuredOutputsParams, str] | None:
        if len(found) > 1:
            raise RequestError(
                f"{found[1][1]} cannot be combined with {found[0][1]}: a request takes one "
                "output constraint",
                found[1][1],
            )
        return found[0] if found else None
