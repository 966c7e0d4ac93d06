"""Resilience analyses above the simulator: fault sensitivity (sensitivity.py), diagnosis from per-rank
collective records (diagnose/), fault files (files.py). What the replay and search read lives below
them: fault specs (specs/faults.py), the goodput model (cost/goodput.py), ECMP traffic (cost/traffic.py)
and faults applied to a step (replay/faults.py)."""
