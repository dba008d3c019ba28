"""A rank process's end, made cheap: the garbage collector's passes over every object during the
interpreter's teardown skipped.

When a Python process ends, after its exit handlers, the interpreter clears its modules and runs
full collections over every object still tracked: with torch imported that cost 0.6-0.9 CPU-s
(0.5 of them in the collector), with megatron-core more, measured on a 2-core machine, on the way
between the program's end and the GPU's release, and on every rank of every launch. Ranks run
`freeze_for_teardown` as their last exit handler (registered before the program's own, so it runs
after them): a full collection of what is garbage by then, finalizers run as Python runs them
(none where the program turned the collector off, as Python does then), and
then every object left is moved out of the collector's sight (`gc.freeze`), so the teardown's
passes find nothing to walk: 0.80-0.90 CPU-s from a torch program's return to its process's end
became 0.34-0.41, 2.64 with Megatron-Bridge imported became 0.85 (bench/RESULTS.md).

What differs from a plain process's end: an object that only becomes unreachable while the
interpreter clears the modules, inside a reference cycle, is not finalized (its `__del__` does not
run), which Python does not promise anyway ("It is not guaranteed that __del__() methods are called
for objects that still exist when the interpreter exits": the data model's reference). Exit handlers,
`weakref.finalize`, non-daemon threads and the flush of sys.stdout/stderr are unchanged.
"""

from __future__ import annotations

import gc


def freeze_for_teardown() -> None:
    if gc.isenabled():  # a program that turned the collector off gets no collection at its end
        gc.collect()
    gc.freeze()
