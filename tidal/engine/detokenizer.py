"""Incremental detokenisation: each output token costs O(1) decode work, not a decode of the
whole output (which made a 4k-token answer cost ~4 s of decoding on one core).

An HF `tokenizers` tokenizer (`TidalTokenizer`) decodes through `tokenizers.decoders.DecodeStream`;
any other `Tokenizer` through `WindowDecodeStream`, vLLM's two-offset scheme (decode a window of
a few tokens before and after the last emitted one, emit the difference once it is whole UTF-8).
Stop strings are cut from the streamed text, and any tail that could still become one is held
back, so streamed text never contains a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers.decoders import DecodeStream

from tidal.engine.api import Tokenizer
from tidal.engine.tokenizer import TidalTokenizer

_WINDOW = 6  # tokens decoded before the new ones: merges and leading spaces depend on them


class _Stream(Protocol):
    def step(self, token_id: int) -> str | None: ...

    def flush(self) -> str: ...


class HfDecodeStream:
    """`DecodeStream` over a `tokenizers` tokenizer (special tokens skipped, as `decode` does)."""

    def __init__(self, tok: TidalTokenizer) -> None:
        self.tok = tok.tok
        self.stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str | None:
        return self.stream.step(self.tok, token_id)  # type: ignore[no-any-return]

    def flush(self) -> str:
        return ""  # NOTE: bytes of an unfinished UTF-8 character at the very end are dropped


class WindowDecodeStream:
    """Any `Tokenizer.decode`: text of ids[prefix:] minus text of ids[prefix:read]."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids up to here are emitted

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True) or ""

    def _delta(self, final: bool) -> str | None:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return None  # nothing new yet, or an incomplete UTF-8 sequence: wait for more bytes
        self.prefix = max(self.prefix, len(self.ids) - _WINDOW)
        self.read = len(self.ids)
        if len(self.ids) > 4 * _WINDOW:  # keep only the window
            del self.ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        return text[len(before) :]


def decode_stream(tok: Tokenizer) -> _Stream:
    return HfDecodeStream(tok) if isinstance(tok, TidalTokenizer) else WindowDecodeStream(tok)


class Detokenizer:
    """Turns a growing list of output ids into text deltas; cuts at the first stop string and
    holds back any tail that could still become one, so streamed text never contains it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._stream = decode_stream(tokenizer)
        self._num_fed = 0  # output ids decoded so far
        self._pending = ""  # decoded text not handed out yet (held back)
        self._pieces: list[str] = []  # text handed out
        self._skip = 0  # characters of decoded text already handed out elsewhere (a migration)

    @property
    def emitted(self) -> str:
        """The text already handed out."""
        return "".join(self._pieces)

    @emitted.setter
    def emitted(self, text: str) -> None:
        """Continue a request whose first `text` was handed out elsewhere (a migrated request):
        the next `update` decodes its output from the start and skips that much."""
        self._stream = decode_stream(self.tokenizer)
        self._num_fed, self._pending, self._pieces, self._skip = 0, "", [text], len(text)

    def update(
        self, token_ids: Sequence[int], final: bool, *, start: int = 0, end: int | None = None
    ) -> tuple[str, bool]:
        """(delta, hit_stop) after the output `token_ids[start:end]` (only its new ids are read).
        `final`: the request ends now, flush what is held back."""
        end = len(token_ids) if end is None else end
        for i in range(start + self._num_fed, end):
            piece = self._stream.step(token_ids[i])
            if piece:
                self._take(piece)
        self._num_fed = max(self._num_fed, end - start)
        if final:
            self._take(self._stream.flush())
        if self.stop:
            hits = [i for s in self.stop if (i := self._pending.find(s)) >= 0]
            if hits:  # NOTE: no stop starts in emitted text: its start would have been held
                return self._emit(min(hits)), True
        keep = 0 if final else self._held_tail(self._pending)
        return self._emit(len(self._pending) - keep), False

    def _take(self, piece: str) -> None:
        if self._skip:
            cut = min(self._skip, len(piece))
            self._skip -= cut
            piece = piece[cut:]
        self._pending += piece

    def _emit(self, n: int) -> str:
        delta, self._pending = self._pending[:n], self._pending[n:]
        if delta:
            self._pieces.append(delta)
        return delta

    def _held_tail(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
