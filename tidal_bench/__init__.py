"""Measurement, apart from the product: `tidal bench`, replay, co-location search, fault kits."""
