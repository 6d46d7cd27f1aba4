"""The scheduler's event trace: with `TIDAL_SIM_STEP_TRACE_DIR` set, one JSON line per report
received, held request dispatched and migration ended, each stamped `unix_s`, in
`scheduler.ndjson` beside the sim engine's step traces (not `*.jsonl`, which `tidal bench
replay` reads as instance traces). Laid beside the instances' `add`/`first` events it shows where
a hand-out's time goes (docs/colocation.md, `online-priority`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from tidal import envs

FILE_NAME = "scheduler.ndjson"


class EventTrace:
    def __init__(self, trace_dir: str | None = None) -> None:
        d = envs.SIM_STEP_TRACE_DIR.get() if trace_dir is None else trace_dir
        self.out: TextIO | None = (Path(d) / FILE_NAME).open("a", buffering=1) if d else None

    @property
    def is_on(self) -> bool:
        return self.out is not None

    def write(self, event: str, **fields: Any) -> None:
        if self.out is not None:
            self.out.write(json.dumps({"event": event, "unix_s": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
