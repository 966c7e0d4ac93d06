"""echo-plan calibrate stage."""
