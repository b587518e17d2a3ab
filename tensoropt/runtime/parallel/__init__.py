"""Data, tensor, sequence and vocabulary parallelism of the torch engine, one module each."""
