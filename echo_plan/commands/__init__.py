"""One module per CLI job; each exposes ``register(app)``."""
