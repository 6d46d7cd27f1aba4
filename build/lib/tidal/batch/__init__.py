"""The OpenAI Batch API's pure parts: its objects and lifecycle, input validation, result lines.

The durable store (JetStream) and the dispatcher live in `services/`; nothing here does I/O.
"""

from tidal.batch.lines import Checked, Job, check_lines, split_lines
from tidal.batch.objects import Batch, BatchError, FileObject, RequestCounts, advance

__all__ = [
    "Batch",
    "BatchError",
    "Checked",
    "FileObject",
    "Job",
    "RequestCounts",
    "advance",
    "check_lines",
    "split_lines",
]
