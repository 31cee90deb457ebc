"""A conversation through the model's chat template into token ids, message content kept as text.

OpenAI treats message content as text: special-token text in it ("<|im_end|><|im_start|>system") must not become
the real special tokens and open a forged turn. The template runs over placeholders, each message's content is
tokenized with special tokens split into plain characters, and only the template's own markers stay special.
Used by the offline LLM.chat and the server's /v1/chat/completions."""
from __future__ import annotations

import re
import secrets
from functools import cache

import jinja2


class ChatTemplateError(ValueError):
    """The model's chat template cannot render these messages as asked."""


def render_chat(tokenizer, messages: list[dict[str, str]], tools: list[dict] | None = None) -> str:
    """The prompt text: the conversation through the model's chat template, ending where the assistant speaks;
    `tools` go to a template that renders them (kvserve/engine/tools.py)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use generate() with a plain prompt")
    try:
        extra = {"tools": tools} if tools is not None else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc


def needs_segments(tokenizer, messages: list[dict[str, str]]) -> bool:
    """Whether any message content holds special-token text (else the whole rendering tokenizes as before)."""
    return any(_special_text(tokenizer).search(m["content"]) for m in messages)


def rendered_segments(tokenizer, messages: list[dict[str, str]],
                      tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """The rendered prompt cut into (text, is message content) pieces: the template runs over placeholders that
    are then replaced by each message's content, so nothing in a content can become template."""
    nonce = secrets.token_hex(8)
    marks = [f"[kvserve-content-{nonce}-{i}]" for i in range(len(messages))]
    rendered = render_chat(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)], tools)
    pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
    found = pieces[1::2]
    if found != [mark for mark in marks if mark in found]:  # each at most once, in order
        raise ChatTemplateError("this model's chat template reorders or repeats message content, so special-token "
                                "text in a message cannot be kept as plain text; remove it from the content")
    content_of = dict(zip(marks, (m["content"] for m in messages)))
    return [(content_of[piece], True) if i % 2 else (piece, False) for i, piece in enumerate(pieces) if piece]


def segment_token_ids(tokenizer, segments: list[tuple[str, bool]]) -> list[int]:
    """Token ids of rendered segments: content with special-token text split into plain characters."""
    return [token_id for text, is_content in segments
            for token_id in tokenizer(text, add_special_tokens=False, split_special_tokens=is_content).input_ids]


@cache
def _special_text(tokenizer) -> re.Pattern:
    """Matches the text of any special token of `tokenizer`."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                      reverse=True)
    return re.compile("|".join(map(re.escape, specials)) or "(?!)")
