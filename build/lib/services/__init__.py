"""Tidal services: thin asyncio adapters around the core; run each as `python -m services.NAME`."""
