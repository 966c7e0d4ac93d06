"""Resilience: faults and stragglers in the replay, the goodput model, fault sensitivity."""
