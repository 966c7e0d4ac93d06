"""echo-plan report stage."""
