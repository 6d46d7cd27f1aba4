"""Tidal: co-located online/offline LLM serving. The pure core library (no network I/O)."""
