"""What of the launching shell's environment reaches every rank (pure).

`FOO=1 torchrun train.py` gives every worker FOO: torchrun's workers inherit its environment. A rank
here is a process a Ray node started, on this machine or another, so the driver forwards its shell's
variables itself, as torchrun's children would have them, less what describes the driver's own
machine, login session or launcher: on another node (or in a Ray worker here) that would be wrong,
and the node has its own (a local run's node has this machine's, driver/cluster/nodeenv.py). The rule is the
same locally and on a cluster. Values are never printed (driver/gang/gang.py, rundir.py redact them).
"""

from __future__ import annotations

from collections.abc import Mapping

from .rankenv import CONTRACT_KEYS, is_startup_var

# The driver's own machine and login session: where things are on it (its paths, home, temp dir,
# virtual env, locale and time zone), who and where the login is, its terminal and desktop, its
# devices. A rank's node has its own.
NOT_FORWARDED_NAMES = frozenset({
    "HOME", "PWD", "OLDPWD", "SHELL", "USER", "LOGNAME", "USERNAME", "HOSTNAME", "HOST", "LANG",
    "LANGUAGE", "TZ", "TMPDIR", "TMP", "TEMP", "TEMPDIR", "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "CUDA_HOME",
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "TERM", "COLORTERM", "COLUMNS",
    "LINES", "SHLVL", "_", "PS1", "PS2", "PS3", "PS4", "PROMPT_COMMAND", "DISPLAY", "WAYLAND_DISPLAY",
    "XAUTHORITY", "DBUS_SESSION_BUS_ADDRESS", "MAIL", "LS_COLORS", "LESSOPEN", "LESSCLOSE", "KRB5CCNAME",
    "STY", "WINDOW", "INVOCATION_ID", "JOURNAL_STREAM", "MANAGERPID", "NOTIFY_SOCKET", "SYSTEMD_EXEC_PID",
    "MOTD_SHOWN", "SPT_NOENV",
})  # fmt: skip
NOT_FORWARDED_PREFIXES = (
    "LC_", "CONDA_", "_CONDA", "PYENV", "SSH_", "XDG_", "TERM_", "TMUX", "HIST", "SUDO_", "VSCODE_",
    "BASH_FUNC_",
    # Ray's and megaray's own settings, and torchrun's agent's (TORCHELASTIC_SIGNALS_TO_HANDLE): the
    # rank's node and megaray set what ranks get of them
    "RAY_", "MEGARAY_", "TORCHELASTIC_",
    # another launcher's view of this process (Slurm's step, MPI's and PMI's ranks, LSF's and PBS's
    # job): Lightning and Accelerate read them to find their rank, which is megaray's to give
    "SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "OMPI_", "LSB_", "PBS_",
)  # fmt: skip
# Search paths (PATH, MANPATH, CPATH, PKG_CONFIG_PATH, CLASSPATH, CUDA_PATH, ...): this machine's.
NOT_FORWARDED_SUFFIXES = ("PATH",)
# Start-up variables that are paths on this machine, as PYTHONPATH and LD_LIBRARY_PATH are
STARTUP_PATHS = frozenset(
    {"PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "LD_PRELOAD"}
)


def is_forwarded(name: str) -> bool:
    """Whether the launching shell's variable `name` reaches every rank. Start-up variables
    (PYTHONHASHSEED, LD_PRELOAD, MALLOC_*: core/rankenv.is_startup_var) do only with `--env NAME`:
    the rank's process must start with them, which a warm pool's or spare's already did, so a shell
    that merely has them (PYTHONUNBUFFERED=1 in many images) would cost every launch its warm
    processes."""
    return not (
        name in NOT_FORWARDED_NAMES
        or name.startswith(NOT_FORWARDED_PREFIXES)
        or name.endswith(NOT_FORWARDED_SUFFIXES)
        or name in CONTRACT_KEYS
        or is_startup_var(name)
    )


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launching shell's variables that every rank gets (`is_forwarded`), by name."""
    return {k: v for k, v in sorted(environ.items()) if is_forwarded(k)}


def startup_not_forwarded(
    environ: Mapping[str, str], process: Mapping[str, str], given: Mapping[str, str]
) -> list[str]:
    """The shell's start-up variables that a rank's process (`process`, its environment) has with
    another value or not at all, and that `--env` or the profile (`given`) does not set: what a
    torchrun user would expect to reach the rank, for a line that says how. Paths are the machine's."""
    return sorted(
        k
        for k, v in environ.items()
        if is_startup_var(k)
        and not k.endswith(NOT_FORWARDED_SUFFIXES)
        and k not in STARTUP_PATHS
        and k not in given
        and process.get(k) != v
    )


SHOWN_NAMES = 10  # a launch names this many of the forwarded variables; spec.json holds every one


def shown_names(names: list[str]) -> str:
    """The forwarded variables' names for the launch's line: a CI runner's shell holds a hundred."""
    more = len(names) - SHOWN_NAMES
    rest = f" and {more} more (spec.json in the run directory)" if more > 0 else ""
    return ", ".join(names[:SHOWN_NAMES]) + rest
