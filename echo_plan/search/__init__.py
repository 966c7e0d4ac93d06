"""echo-plan search stage."""
