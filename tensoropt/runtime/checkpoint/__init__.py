"""Sharded checkpoints of the torch engine and the files of a checkpoint directory."""
