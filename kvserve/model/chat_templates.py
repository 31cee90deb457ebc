"""Chat templates for model families whose GGUF files can come without one (the Gemma 3 270M on PyPI does)."""
from __future__ import annotations

# Gemma's turn format after the BOS: <start_of_turn>user|model, the text, <end_of_turn>; a system message opens the
# first user turn. kvserve tokenizes a rendered chat prompt without adding special tokens, as the template has them.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_prefix = '' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with the user') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ (system_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
FALLBACK_CHAT_TEMPLATES = {"gemma3_text": GEMMA3_CHAT_TEMPLATE}


def fallback_chat_template(model_type: str) -> str | None:
    """The family's chat template, for a converted GGUF whose tokenizer has none; None for other families."""
    return FALLBACK_CHAT_TEMPLATES.get(model_type)
