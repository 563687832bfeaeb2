"""What a run reports about itself: per-batch process facts, metric names, time and memory analysis."""
