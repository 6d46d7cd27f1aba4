"""The KV data plane: raw transfer, and migration between real engines."""
