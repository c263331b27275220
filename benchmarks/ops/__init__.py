"""One benchmark per op, each against a baseline timed in the same process."""
