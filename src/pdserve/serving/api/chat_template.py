"""Which chat template renders a conversation, and in which content format.

Source order: the ``--chat-template`` override (a file path, or an inline Jinja string;
resolved once when the app is built) wins over the tokenizer's own template. With
neither, chat requests are rejected with 400.

Content format of message ``content`` given as a list of ``{"type": "text"}`` parts:

* ``"string"``: the parts' texts are joined with ``"\\n"`` into one string;
* ``"openai"``: the list of parts is passed to the template as is;
* ``"auto"``: ``"openai"`` when the template loops over a message's content,
  else ``"string"`` (decided once per template text and cached).

Rendering runs the tokenizer's ``apply_chat_template`` (blocking; callers run it in
the tokenizer thread). Request ``tools`` go to the template as ``tools``; an assistant
message's ``tool_calls`` go with ``arguments`` decoded to an object (templates iterate
them), a ``tool`` message keeps its ``tool_call_id``. A template that fails on the given messages (for example one
that raises "roles must alternate") is a client error: :class:`RequestError`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pdserve.serving.api.protocol import ChatMessageParam, RequestError
from pdserve.serving.api.protocol_chat import template_tool_calls

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")

# "{% for part in message['content'] %}" / "message.content" / "msg['content']" ...
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)"
)


def resolve_chat_template(value: str | None) -> str | None:
    """The template text of a ``--chat-template`` value (a file path or inline Jinja)."""
    if value is None:
        return None
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline:
        path = Path(value).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(
                f"--chat-template {value!r} is neither a readable file ({e.strerror}) "
                "nor an inline Jinja template"
            ) from e
    return value


def detect_content_format(template: str) -> ContentFormat:
    return "openai" if _LOOPS_OVER_CONTENT.search(template) else "string"


class ChatTemplates:
    """Template choice and rendering for one app (read-only after construction,
    apart from the per-template format cache)."""

    def __init__(self, override: str | None, content_format: str) -> None:
        if content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                f"got {content_format!r}"
            )
        self.override = resolve_chat_template(override)
        self.content_format_setting = content_format
        self._detected: dict[str, ContentFormat] = {}

    def template_for(self, tokenizer: Any) -> str:
        template = self.override or getattr(tokenizer, "chat_template", None)
        if not template:
            raise RequestError(
                "this model has no chat template; start the server with --chat-template "
                "or use /v1/completions",
                "messages",
            )
        return str(template)

    def content_format(self, template: str) -> ContentFormat:
        if self.content_format_setting == "string":
            return "string"
        if self.content_format_setting == "openai":
            return "openai"
        fmt = self._detected.get(template)
        if fmt is None:
            fmt = self._detected[template] = detect_content_format(template)
        return fmt

    @staticmethod
    def conversation(messages: list[ChatMessageParam], fmt: ContentFormat) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            content: Any
            if m.content is None:
                content = "" if fmt == "string" else []
            elif isinstance(m.content, str):
                content = m.content if fmt == "string" else [{"type": "text", "text": m.content}]
            elif fmt == "string":
                content = "\n".join(part.text for part in m.content)
            else:
                content = [{"type": "text", "text": part.text} for part in m.content]
            msg: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls is not None:
                msg["tool_calls"] = template_tool_calls(m.tool_calls, f"messages.{i}")
            out.append(msg)
        return out

    def render(
        self,
        tokenizer: Any,
        messages: list[ChatMessageParam],
        *,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text; blocking (Jinja), so run it off the event loop. ``tools``
        (OpenAI function tools, as dicts) are passed to the template as ``tools``."""
        template = self.template_for(tokenizer)
        conversation = self.conversation(messages, self.content_format(template))
        try:
            prompt = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                **({"tools": tools} if tools else {}),
                **(template_kwargs or {}),
            )
        except Exception as e:  # the template rejected these messages
            raise RequestError(
                f"chat template could not render the messages: {e}", "messages"
            ) from e
        if not isinstance(prompt, str):
            raise RequestError("chat template did not render to text", "messages")
        return prompt
