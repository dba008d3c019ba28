"""A launch's lifecycle: the launch read top-down (launch.py), the controller's states (controller.py),
one attempt (attempt.py), what attempts share (context.py), stop signals and the target registry."""
