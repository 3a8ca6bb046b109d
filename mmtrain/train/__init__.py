"""The training step loop, optimizer, schedules, checkpoints and metrics."""
