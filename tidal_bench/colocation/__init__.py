"""Online latency beside offline work, and the live max-offline search."""
