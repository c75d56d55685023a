"""Chat templates for GGUF files that carry none (``tokenizer.chat_template`` absent), keyed by
``general.architecture``. Used only as a fallback: a template in the file always wins.

Each is a jinja string in transformers' chat-template conventions (``messages``, ``bos_token``,
``add_generation_prompt``, ``raise_exception``), written from the model family's published prompt format.
"""

from __future__ import annotations

# Gemma's turn format (Gemma 3 model card and tokenizer_config.json): <bos> first; each turn is
# "<start_of_turn>{user|model}\n{text}<end_of_turn>\n"; Gemma has no system role, so a system message is
# prepended to the first user turn followed by a blank line; the prompt for a reply is "<start_of_turn>model\n".
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- set system = system if system is string else system | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\n') -%}"
    "{%- set first_user_prefix = system + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma conversations must alternate user and assistant turns, starting with user "
    "(after an optional system message)') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {"gemma3": GEMMA}


def builtin_chat_template(architecture: str | None) -> str | None:
    """The built-in template for a GGUF ``general.architecture``, or None where there is none."""
    return BUILTIN_CHAT_TEMPLATES.get(architecture) if architecture else None
