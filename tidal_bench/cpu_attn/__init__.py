"""What CPU-attention workers add to a live instance, and their bandwidth bound."""
