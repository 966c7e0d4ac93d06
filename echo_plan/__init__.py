"""echo-plan: find the fastest LLM training plan that fits, by simulating it as Echo does."""

__version__ = "0.1.0"
