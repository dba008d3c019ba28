"""Pure decisions, shared by the driver, the ranks and the command line: the spec, the target, rank
order and env, layouts, recipes and profiles as data, the errors. Nothing here imports Ray or torch
(a test checks it), so `--help` and bad input stay fast and all of it is tested without processes."""
