"""Run directories, the results format and resumable checkpoints."""
