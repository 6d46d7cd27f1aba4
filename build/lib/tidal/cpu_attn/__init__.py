"""CPU attention (OmniServe §3.2): the wire between an instance and its CPU-attention workers
(`wire`) and a worker's host KV store with its attention kernel (`kv_store`). Pure: no sockets
here; `services/cpu_attn` serves the store and `services/instance/cpu_attn_link.py` is the
instance's client."""
