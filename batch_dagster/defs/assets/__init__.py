"""The batch lifecycle as assets, in data-flow order, and their checks."""
