"""What a rank holds: meta-built models given storage, recomputation, and the peak-memory check."""
