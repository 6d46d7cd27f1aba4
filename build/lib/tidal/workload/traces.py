"""Request traces on disk: timestamped traces and length tables, loaded into numpy arrays.

Two CSV layouts are understood (see `data/README.md`):
* ``arrival_s,input_tokens,output_tokens`` (the `*.norm.csv` files, or a user's own trace);
* ``num_prefill_tokens,num_decode_tokens,...`` (ShareGPT / arXiv length tables, no timestamps).
A bare file name is looked up in the data directory: env ``TIDAL_DATA_DIR``, else the
repository's own ``data/`` (the traces ship with the repository, licences included).
"""

from __future__ import annotations

import csv
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """Where trace files named without a directory are found."""
    env = os.environ.get("TIDAL_DATA_DIR")
    return Path(env) if env else _REPO_ROOT / "data"


def resolve(path: str | Path) -> Path:
    """`path` as given if it exists (or has a directory part), else inside `data_dir()`."""
    p = Path(path)
    if p.exists() or p.parent != Path("."):
        return p
    return data_dir() / p


@dataclass(frozen=True)
class Trace:
    """Lengths, and arrival times when the file has them (sorted, seconds from the first)."""

    name: str
    input_tokens: np.ndarray  # (N,) int64
    output_tokens: np.ndarray  # (N,) int64
    arrival_s: np.ndarray | None  # (N,) float64, or None for a length table

    def __len__(self) -> int:
        return len(self.input_tokens)


@functools.lru_cache(maxsize=16)
def _load(path: str) -> Trace:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"trace {p} not found (set TIDAL_DATA_DIR or give a path; data dir is {data_dir()})"
        )
    with p.open(newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader)]
        rows = [r for r in reader if r]
    cols = {h: i for i, h in enumerate(header)}
    if {"input_tokens", "output_tokens"} <= cols.keys():
        ii, oi = cols["input_tokens"], cols["output_tokens"]
    elif {"num_prefill_tokens", "num_decode_tokens"} <= cols.keys():
        ii, oi = cols["num_prefill_tokens"], cols["num_decode_tokens"]
    elif {"ContextTokens", "GeneratedTokens"} <= cols.keys():
        raise ValueError(f"{p}: raw Azure trace; use the normalised *.norm.csv file instead")
    else:
        raise ValueError(
            f"{p}: expected columns arrival_s,input_tokens,output_tokens or "
            f"num_prefill_tokens,num_decode_tokens; got {header}"
        )
    inp = np.array([int(float(r[ii])) for r in rows], dtype=np.int64)
    out = np.array([int(float(r[oi])) for r in rows], dtype=np.int64)
    arr = None
    if "arrival_s" in cols:
        ai = cols["arrival_s"]
        arr = np.array([float(r[ai]) for r in rows], dtype=np.float64)
        order = np.argsort(arr, kind="stable")
        arr, inp, out = arr[order], inp[order], out[order]
        arr = arr - arr[0] if len(arr) else arr
    # Degenerate rows (no prompt or no output) cannot be served; clamp to one token.
    np.maximum(inp, 1, out=inp)
    np.maximum(out, 1, out=out)
    for a in (inp, out) + ((arr,) if arr is not None else ()):
        a.setflags(write=False)
    return Trace(p.name, inp, out, arr)


def load_trace(path: str | Path) -> Trace:
    """Load (and cache) a trace or length table; bare names come from the data directory."""
    return _load(str(resolve(path).resolve()))
