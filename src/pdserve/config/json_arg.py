"""The JSON-object flags (``--compilation-config``, ``--kv-transfer-config``,
``--speculative-config``): one parser, so each refuses bad input with the same words."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def parse_json_arg(value: str | Mapping[str, Any], flag: str) -> dict[str, Any]:
    """The flag's JSON object as a new dict: text as given on the command line, or a
    mapping already parsed (from a topology file or the offline API). ``ValueError``
    naming ``flag`` for text that is not JSON or not an object."""
    if not isinstance(value, str):
        return dict(value)
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return obj
