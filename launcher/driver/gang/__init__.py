"""The ranks of one attempt as a gang: their placement groups and actors, where they come from (fresh,
the warm spares, a pool: sources.py), their port, links and env; a rank group on top of it (group.py)."""
