"""Rank output and what the driver shows and keeps of it: the sink and relay, the rank logs, the run
directory, progress and metrics."""
