"""What runs in a rank's process (or in a task on a rank's node): the actor, its output capture and
progress reports, a warm spare's imports, and the probes the driver asks for. Nothing here imports
torch at import time: CUDA and OpenMP read their env when they first load."""
