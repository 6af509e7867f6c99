"""The grammar a :class:`~pdserve.core_types.sampling_params.StructuredOutputsParams`
stands for, built with xgrammar without a tokenizer: what the API server builds to refuse
an invalid schema, regex or grammar (a 400 before the engine sees the request), and what
the engine core compiles against the model's tokenizer
(:mod:`pdserve.engine.structured_output`).

Process-neutral: it imports no engine code, and nothing heavy at import time: xgrammar
(which loads torch) is imported on the first call, so a process that never builds a
grammar never pays for it. The API process and the engine-core process both use it.
"""

from __future__ import annotations

import re
from typing import Any

from pdserve.core_types.sampling_params import StructuredOutputsParams

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[18:58:16] /path/file.cc:94: "


def _ebnf_literal(text: str) -> str:
    """``text`` as a double-quoted EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# Characters of JSON strings as xgrammar's schema converter writes them: a plain string's
# admits UTF-8-encoded surrogates (U+D800-U+DFFF, not valid UTF-8: they decode as
# replacement characters), and a minLength / maxLength string's admits raw control
# characters too (U+0000-U+001F, which RFC 8259 forbids inside strings and json.loads
# rejects). Both are rewritten to exclude them.
_STRING_CHARS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
_JSON_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"


def _json_only(grammar: Any) -> Any:
    """``grammar`` (converted from a JSON schema) with every string character rule
    excluding control characters and surrogates: what it accepts then always parses with
    a strict JSON parser, and a string's length is what the schema's validator counts."""
    import xgrammar as xgr

    text = str(grammar)
    fixed = text
    for chars in _STRING_CHARS:
        fixed = fixed.replace(chars, _JSON_CHAR)
    if fixed == text:
        return grammar
    return xgr.Grammar.from_ebnf(fixed)


def build_grammar(spec: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` of ``spec`` (no tokenizer needed). Raises ``ValueError``
    with xgrammar's reason when the schema, regex or grammar is invalid."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else _JSON_OBJECT_SCHEMA
            assert schema is not None
            return _json_only(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        if kind == "regex":
            assert spec.regex is not None
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            alternatives = " | ".join(_ebnf_literal(c) for c in spec.choice or [])
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        assert spec.grammar is not None
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        text = str(e).strip()
        reason = _XGR_PREFIX.sub("", text.splitlines()[-1]) if text else type(e).__name__
        raise ValueError(f"invalid {kind} for structured output: {reason}") from None
