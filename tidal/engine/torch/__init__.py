"""Tidal's own PyTorch engine: a paged-KV Llama-family model, its runner, KV cache and
migration, oneDNN packing and native decode kernels, and the dtype chosen per CPU."""
