"""Incremental detokenisation (`tidal.engine.detokenizer`): the streamed text equals one full
decode, token by token, for an HF tokenizer (DecodeStream) and a byte-level one (window)."""

from __future__ import annotations

import pytest

from tidal.engine.api import Tokenizer
from tidal.engine.detokenizer import Detokenizer, HfDecodeStream, WindowDecodeStream
from tidal.engine.sim.tokens import SimTokenizer, load_sim_tokenizer

TEXT = "The tide comes in; naïve café 海 🌊 over the reef.\n" * 3


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return load_sim_tokenizer("")  # the embedded SmolLM2's tokenizer (tokenizers, no torch)


def stream(tok: Tokenizer, ids: list[int], stop: list[str], n: int | None = None) -> list[str]:
    d = Detokenizer(tok, stop)
    return [d.update(ids, k == len(ids), end=k)[0] for k in range(1, (n or len(ids)) + 1)]


@pytest.mark.parametrize("which", ["hf", "bytes"])
def test_streamed_text_equals_a_full_decode(which: str, hf: Tokenizer) -> None:
    tok = hf if which == "hf" else SimTokenizer()
    ids = tok.encode(TEXT)
    deltas = stream(tok, ids, [])
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # a split UTF-8 character waits for its bytes
    kind = HfDecodeStream if which == "hf" else WindowDecodeStream
    assert isinstance(Detokenizer(tok, [])._stream, kind)


def test_stop_string_across_tokens_is_cut(hf: Tokenizer) -> None:
    ids = hf.encode(TEXT)
    d = Detokenizer(hf, ["café 海"])
    out, hit = "", False
    for k in range(1, len(ids) + 1):
        delta, hit = d.update(ids, False, end=k)
        out += delta
        if hit:
            break
    assert hit and out == "The tide comes in; naïve "


def test_a_migrated_request_continues_after_what_was_emitted(hf: Tokenizer) -> None:
    ids = hf.encode(TEXT)
    first = "".join(stream(hf, ids, ["zzz"], n=10))
    moved = Detokenizer(hf, ["zzz"])
    moved.emitted = first  # as `kv_transfer.import_seq` sets it
    rest = [moved.update(ids, k == len(ids), end=k)[0] for k in range(11, len(ids) + 1)]
    assert first + "".join(rest) == TEXT
    assert moved.emitted == TEXT
