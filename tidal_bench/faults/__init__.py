"""Kill -9 parts of a running stack and time what survives (bench and fault tests)."""
