"""Tidal services: thin asyncio adapters around the core, each run as `python -m services.<name>`."""
