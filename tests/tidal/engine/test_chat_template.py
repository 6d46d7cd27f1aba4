"""The chat template is rendered in a sandbox: a model directory's template is untrusted."""

from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer, models

from tidal.engine.tokenizer import TidalTokenizer

# Reaches Python's object graph from a string: under a plain jinja2.Environment it lists every
# class the process has loaded (and from there, os.system).
INJECTION = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
MUTATION = "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages|length }}"


def tokenizer(template: str) -> TidalTokenizer:
    return TidalTokenizer(Tokenizer(models.BPE()), template, eos_token_id=None)


def test_a_template_cannot_reach_python_internals() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer(INJECTION).apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_cannot_mutate_the_messages() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer(MUTATION).apply_chat_template([{"role": "user", "content": "hi"}])


def test_an_ordinary_template_still_renders() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tokenizer(template).apply_chat_template(msgs) == "<|user|>hi\n<|assistant|>"
