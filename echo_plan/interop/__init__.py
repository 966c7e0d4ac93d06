"""echo-plan interop stage."""
