"""Event-driven replay: one layer on its streams (level 1), the pipeline schedule (level 2)."""
