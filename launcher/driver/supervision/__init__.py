"""Watching ranks and nodes while they run: how each rank ends, the nodes' liveness, hangs,
stragglers, and growing back to MAX nodes."""
