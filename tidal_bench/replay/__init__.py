"""A trace window through the live stack and through the simulator (`tidal bench replay`)."""
