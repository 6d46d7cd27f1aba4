"""`tidal bench checkpoint`: what preempting offline decodes costs with and without KV
checkpoints (issue 39 item 3, ConServe), on the torch engine and in the simulator."""
