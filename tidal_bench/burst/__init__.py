"""`tidal bench burst`: swinging online traffic beside Batch API jobs, live and simulated."""
