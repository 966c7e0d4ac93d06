"""Checks of the planner's predictions against published measurements (../shared/validation/)."""
