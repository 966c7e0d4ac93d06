"""Pure cost functions: op -> seconds (compute, collectives) and plan -> bytes (memory)."""
