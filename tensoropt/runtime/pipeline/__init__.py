"""Pipeline stages: cutting, tracing, tensor parallelism inside them, and their schedule."""
