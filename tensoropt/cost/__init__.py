"""Cost model: pure functions of (op, strategy, cluster, profile) -> time and memory."""
