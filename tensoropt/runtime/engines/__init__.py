"""The engines a plan runs on (torch, DeepSpeed), their precision, optimizer groups and compile."""
