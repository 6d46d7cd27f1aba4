"""Tokens of the `sim` engine: the served model's tokenizer, and the emulated output words.

The sim engine counts prompt tokens with the tokenizer of the model it stands in for, as a real
server does (default: the embedded SmolLM2's, a copy shipped in this package: no torch, no GGUF).
Its output is a deterministic function of (prompt, index) drawn from ~20 whole-word tokens of that
vocabulary, so the text reads as words and the same prompt always gives the same text; it is
never EOS.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import shutil
import tempfile
from array import array
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from tidal.engine.api import Tokenizer

__all__ = [
    "SIM_WORDS",
    "SimTokenizer",
    "cut_at_stop",
    "load_sim_tokenizer",
    "output_word_ids",
    "prompt_key",
    "shipped_tokenizer_dir",
    "sim_token",
]

SHIPPED_TOKENIZER = "data/smollm2"  # under tidal/engine/: tokenizer.json.gz + its config

SIM_WORDS = (
    "tide",
    "sea",
    "flow",
    "wave",
    "shore",
    "moon",
    "current",
    "surf",
    "swell",
    "reef",
    "harbor",
    "sail",
    "drift",
    "foam",
    "coral",
    "kelp",
    "gull",
    "buoy",
    "anchor",
    "beacon",
)
_WORD_BASE = 256  # SimTokenizer: ids 0..255 are bytes; 256.. are whole words


class SimTokenizer:
    """Byte-level tokenizer with a few whole-word tokens for the emulated output (`tokenizer=
    "bytes"`: for tests that want no model files)."""

    eos_token_id: int | None = None
    vocab_size = _WORD_BASE + len(SIM_WORDS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        out: list[str] = []
        raw = bytearray()
        for tid in token_ids:
            if tid < _WORD_BASE:
                raw.append(tid)
                continue
            if raw:
                out.append(raw.decode("utf-8", errors="replace"))
                raw.clear()
            out.append(" " + SIM_WORDS[(tid - _WORD_BASE) % len(SIM_WORDS)])
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        turns = [f"<|{m['role']}|>{m['content']}\n" for m in messages]
        return "".join(turns) + "<|assistant|>"


@functools.lru_cache(maxsize=8)
def load_sim_tokenizer(spec: str = "") -> Tokenizer:
    """ "" = the embedded SmolLM2's (the copy shipped in this package, `shipped_tokenizer_dir`);
    "bytes" = `SimTokenizer`; else a GGUF file or an HF directory with tokenizer.json. Cached per
    process (a GGUF's first load takes ~2 s, then ~0.1 s from the on-disk cache); raises
    `tidal.engine.tokenizer.ModelLoadError`."""
    if spec == "bytes":
        return SimTokenizer()
    from tidal.engine.tokenizer import load_tokenizer

    return load_tokenizer(spec or shipped_tokenizer_dir())


def shipped_tokenizer_dir() -> Path:
    """An HF tokenizer directory of the embedded SmolLM2, unpacked once from the package's data
    (`tidal/engine/data/smollm2/`) into the cache: a control-plane install has neither torch nor
    the model's GGUF, and still counts the tokens the embedded model would."""
    from tidal.engine.tokenizer import cache_dir

    data = files("tidal.engine") / SHIPPED_TOKENIZER
    packed = (data / "tokenizer.json.gz").read_bytes()
    config = (data / "tokenizer_config.json").read_bytes()
    key = hashlib.blake2b(packed + config, digest_size=8).hexdigest()
    out = cache_dir() / f"smollm2-{key}-tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        (tmp / "tokenizer.json").write_bytes(gzip.decompress(packed))
        (tmp / "tokenizer_config.json").write_bytes(config)
        os.replace(tmp, out)  # atomic: a concurrent loader sees both files or none
    except OSError:
        if not (out / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def output_word_ids(tok: Tokenizer) -> tuple[int, ...]:
    """The ids the sim engine emits: each `SIM_WORDS` word (with its leading space) that is one
    token of `tok` and not EOS."""
    if isinstance(tok, SimTokenizer):
        return tuple(range(_WORD_BASE, _WORD_BASE + len(SIM_WORDS)))
    ids: list[int] = []
    for word in SIM_WORDS:
        enc = tok.encode(" " + word)
        if len(enc) == 1 and enc[0] != tok.eos_token_id and enc[0] not in ids:
            ids.append(enc[0])
    if len(ids) < 4:
        raise ValueError("the tokenizer has too few whole-word tokens for the sim engine's output")
    return tuple(ids)


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """A digest of the whole prompt; with the output index it picks every emulated token."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=16).digest()


def sim_token(key: bytes, index: int, word_ids: Sequence[int]) -> int:
    """Emulated output token `index` of the prompt whose `prompt_key` is `key`."""
    digest = hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()
    return word_ids[int.from_bytes(digest[:4], "little") % len(word_ids)]


def cut_at_stop(text: str, delta: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """(delta up to the first stop string completed by it, whether one was). NOTE: unlike the
    torch engine's Detokenizer it holds nothing back, so a stop string spanning tokens may show
    its first part before the request stops."""
    full = text + delta
    hits = [i for s in stops if s and (i := full.find(s, max(0, len(text) - len(s) + 1))) >= 0]
    if not hits:
        return delta, False
    return full[len(text) : max(len(text), min(hits))], True
