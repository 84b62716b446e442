"""Fault injection against the whole pipeline: the chaos harness and its drills."""
