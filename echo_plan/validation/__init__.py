"""Checks of the planner's predictions against published measurements (echo_plan/data/validation/, which ship with the package)."""
