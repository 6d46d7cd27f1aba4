"""The SmolLM2 tokenizer shipped for the `sim` engine is the one the GGUF reader builds from the
embedded model: same tokenizer.json, same template, same ids."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tidal.engine.sim.tokens import SHIPPED_TOKENIZER, load_sim_tokenizer, shipped_tokenizer_dir
from tidal.engine.tokenizer import embedded_model_path, load_tokenizer

REFRESH = (
    "the shipped copy is stale; rewrite it from the GGUF reader's output "
    "(tidal/engine/data/smollm2/: tokenizer.json gzipped, tokenizer_config.json)"
)


def test_shipped_tokenizer_equals_the_gguf_readers(tmp_path: Path) -> None:
    from_gguf = load_tokenizer(embedded_model_path())
    shipped = load_tokenizer(shipped_tokenizer_dir())
    assert json.loads(from_gguf.tok.to_str()) == json.loads(shipped.tok.to_str()), REFRESH
    assert shipped.chat_template == from_gguf.chat_template, REFRESH
    assert shipped.eos_token_id == from_gguf.eos_token_id == shipped.tok.token_to_id("<|im_end|>")
    text = "Tidal serves 12345 tokens: héllo <|im_start|>user\nwörld"
    assert shipped.encode(text) == from_gguf.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert shipped.apply_chat_template(msgs) == from_gguf.apply_chat_template(msgs)


def test_sim_engine_default_tokenizer_is_the_shipped_one() -> None:
    tok = load_sim_tokenizer("")
    assert tok.vocab_size == 49152
    assert tok.decode(tok.encode("the tide comes in")) == "the tide comes in"
    packed = Path(__file__).parents[4] / "tidal" / "engine" / SHIPPED_TOKENIZER
    assert gzip.decompress((packed / "tokenizer.json.gz").read_bytes()).startswith(b"{")
