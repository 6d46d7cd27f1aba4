"""Wire messages (`messages`: data, `control`: control), subject builders (`subjects`) and their
codec (`codec`)."""

from tidal.schemas import codec, control, messages, subjects

__all__ = ["codec", "control", "messages", "subjects"]
