"""Built-in chat templates: used for a GGUF without ``tokenizer.chat_template`` whose architecture has one."""

from __future__ import annotations

import jinja2
import pytest

from mcp2026.loading.chat_templates import BUILTIN_CHAT_TEMPLATES, builtin_chat_template
from mcp2026.loading.tokenizer import Tokenizer
from spm_reference import write_spm_gguf

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hi!\n"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
]
# Gemma's format: <bos>, then "<start_of_turn>{user|model}\n{text}<end_of_turn>\n" per turn (text trimmed),
# the system message and a blank line at the head of the first user turn, "<start_of_turn>model\n" to reply.
EXPECTED = (
    "<bos><start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nBye<end_of_turn>\n"
    "<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    flags = {"add_bos_token": True, "add_space_prefix": False}  # as Gemma's GGUF says
    return Tokenizer.from_gguf(write_spm_gguf(tmp_path_factory.mktemp("t") / "gemma.gguf", flags=flags))


def test_gemma3_without_a_template_gets_the_builtin(gemma):
    assert gemma.chat_template == BUILTIN_CHAT_TEMPLATES["gemma3"]
    assert gemma.apply_chat_template(CONVERSATION) == EXPECTED
    assert gemma.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi!<end_of_turn>\n"
    )


def test_gemma_prompt_tokens(gemma):
    ids = gemma.encode_chat(CONVERSATION[:2])
    assert ids[0] == gemma.bos_token_id and ids.count(gemma.bos_token_id) == 1  # the template writes <bos>
    assert gemma.decode(ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    )


def test_end_of_turn_stops_generation(gemma):
    end_of_turn = gemma.backend.token_to_id("<end_of_turn>")
    assert gemma.eos_token_ids == (gemma.backend.token_to_id("<eos>"), end_of_turn)


def test_roles_must_alternate(gemma):
    with pytest.raises(jinja2.TemplateError, match="alternate user and assistant"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_template_in_the_file_wins(tmp_path):
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokenizer = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "own.gguf", chat_template=own))
    assert tokenizer.chat_template == own
    assert tokenizer.eos_token_ids == (tokenizer.backend.token_to_id("<eos>"),)


def test_no_builtin_keeps_no_template(tmp_path):
    tokenizer = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "llama.gguf", architecture="llama"))
    assert tokenizer.chat_template is None and builtin_chat_template("llama") is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_gguf_reader_source_sees_the_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = write_spm_gguf(tmp_path / "reader.gguf", flags={"add_space_prefix": False})
    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert tokenizer.chat_template == BUILTIN_CHAT_TEMPLATES["gemma3"]
    assert tokenizer.encode("<start_of_turn>user") == Tokenizer.from_gguf(path).encode("<start_of_turn>user")
