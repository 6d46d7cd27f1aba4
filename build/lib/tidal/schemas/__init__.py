"""Wire messages (`messages`), subject builders (`subjects`) and their codec (`codec`)."""

from tidal.schemas import codec, messages, subjects

__all__ = ["codec", "messages", "subjects"]
