"""Text parsers of model output: reasoning (``<think>`` … ``</think>``) and tool calls.

Both are incremental: they take the output text in whatever pieces the detokenizer
produces and hold back only what could still be the start of a marker, so a marker
split across stream chunks at any position is recognised. Feeding the whole text at
once and then finishing gives the same split as feeding it piece by piece.
"""

from pdserve.frontend.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningSplit,
    thinking_disabled,
)
from pdserve.frontend.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedToolCall,
    ToolCallParser,
    ToolEvents,
    make_tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ParsedToolCall",
    "ReasoningParser",
    "ReasoningSplit",
    "ToolCallParser",
    "ToolEvents",
    "make_tool_call_parser",
    "thinking_disabled",
]
