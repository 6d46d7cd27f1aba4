"""The sim engine: the same control surface as the torch engine, with step times from a latency
model (`tidal.perf`) instead of a model's compute; emulated figures say so."""
