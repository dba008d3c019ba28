"""The environment each rank gets, and the rules that decide it (pure, so it is tested without Ray).

Precedence, stated once:
  1. the launcher contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, CUDA_VISIBLE_DEVICES, ...):
     always the launcher's; asking for one of them in `--env` or a profile is an error, and a value
     the node already had is replaced with a logged note;
  2. `--env KEY=VALUE` on the command line;
  2b. what the launching shell exported, as torchrun's workers inherit it, less what describes the
     driver's own machine, session or launcher (core/shellenv.py);
  3. the env profile (`--env-profile`);
  4. what the node's Ray worker inherited (the environment `ray start` ran with);
  5. the launcher defaults (OMP_NUM_THREADS=1, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, as torchrun; and
     GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME naming the interface of the node's Ray IP).
A higher level that changes a lower level's value is logged, never silent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .topology import RankSlot, visible_devices

# What torchrun sets for each worker, plus NODE_RANK (set by many launchers and read by Megatron
# tooling) and CUDA_VISIBLE_DEVICES (see topology.visible_devices).
CONTRACT_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "NODE_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "CUDA_VISIBLE_DEVICES",
)

# torchrun's defaults. Ray would otherwise give each actor OMP_NUM_THREADS=<its CPUs>; one
# Megatron-on-Ray user measured optimizer setup at 1,012 s instead of 26 s for that.
DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def contract_env(
    slot: RankSlot,
    *,
    world_size: int,
    local_world_size: int,
    num_nodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    visible_devices: str,
    restart_count: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The torchrun env contract for one rank."""
    env = {
        "RANK": slot.rank,
        "LOCAL_RANK": slot.local_rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": slot.node_rank,
        "GROUP_WORLD_SIZE": num_nodes,
        "NODE_RANK": slot.node_rank,
        "ROLE_RANK": slot.rank,
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        # rank 0's process serves the store at MASTER_ADDR:MASTER_PORT before any program runs, as
        # torchrun's agent does (rank/store.py): every rank's env:// rendezvous is then its client
        "TORCHELASTIC_USE_AGENT_STORE": True,
        "CUDA_VISIBLE_DEVICES": visible_devices,
    }
    return {k: str(v) for k, v in env.items()}


@dataclass(frozen=True)
class EnvDecision:
    """The variables to set in one rank, and the log lines that explain each non-obvious choice."""

    to_set: dict[str, str]
    notes: tuple[str, ...]


def check_user_env(env: Mapping[str, str], source: str) -> None:
    """`--env` and profiles may not set contract variables: the launcher owns them."""
    clash = sorted(k for k in env if k in CONTRACT_KEYS)
    if clash:
        raise ValueError(
            f"{source} sets {', '.join(clash)}, which the launcher sets for every rank; "
            f"remove {'it' if len(clash) == 1 else 'them'} from {source}"
        )
    for key in env:
        if (
            not key
            or not (key[0].isalpha() or key[0] == "_")
            or not all(c.isalnum() or c == "_" for c in key)
        ):
            raise ValueError(f"{source}: {key!r} is not a valid environment variable name")


_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
REDACTED = "<redacted>"


def is_secret(name: str) -> bool:
    """Names that suggest a secret: their values are never printed or written to the run directory."""
    return bool(_SECRET.search(name))


# Credentials inside values whatever the name: `scheme://user:password@host` and bearer tokens.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s]+(?=@)")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


def redact_value(value: str) -> str:
    """`value` with embedded credentials replaced: the password of a URL, a bearer token."""
    value = _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED, value)
    return _BEARER.sub(lambda m: m.group("head") + REDACTED, value)


def _redacted(name: str, value: str) -> str:
    return REDACTED if is_secret(name) else redact_value(value)


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """Values of secret-looking names replaced whole; credentials embedded in other values replaced."""
    return {k: _redacted(k, v) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line as others may see it (Ray's job table shows the driver's): each `--env
    NAME=VALUE` (or `--env=NAME=VALUE`) redacted as `redact` does the variable, credentials
    embedded in any other argument replaced."""

    def assignment(text: str) -> str:
        name, value = text.split("=", 1)
        return f"{name}={_redacted(name, value)}"

    out: list[str] = []
    env_next = False
    for arg in argv:
        if env_next and "=" in arg:
            out.append(assignment(arg))
        elif arg.startswith("--env=") and "=" in arg[6:]:
            out.append("--env=" + assignment(arg[6:]))
        else:
            out.append(redact_value(arg))
        env_next = arg == "--env"
    return out


def _shown(key: str, value: str) -> str:
    return REDACTED if is_secret(key) else repr(redact_value(value))


def decide_env(
    contract: Mapping[str, str],
    *,
    node_env: Mapping[str, str],
    profile: Mapping[str, str],
    profile_name: str | None,
    overrides: Mapping[str, str],
    forwarded: Mapping[str, str] = {},
    defaults: Mapping[str, str] = DEFAULTS,
) -> EnvDecision:
    """Apply the precedence in the module docstring. `node_env` is what the worker inherited."""
    to_set: dict[str, str] = {}
    notes: list[str] = []
    upper = {**forwarded, **overrides}  # --env, then what the launching shell exported
    for key, value in contract.items():
        old = node_env.get(key)
        if old is not None and old != value and key != "CUDA_VISIBLE_DEVICES":
            notes.append(f"{key}: node had {_shown(key, old)}, launcher sets {_shown(key, value)}")
        to_set[key] = value
    for key, value in defaults.items():
        if key in upper or key in profile:
            continue
        old = node_env.get(key)
        if old is None:
            to_set[key] = value
        elif old != value:
            shown = f"keeping the node's {_shown(key, old)} (launcher default {_shown(key, value)})"
            notes.append(f"{key}: {shown}")
    for key, value in profile.items():
        if key in upper:
            continue
        old = node_env.get(key)
        if old is not None and old != value:
            shown = f"profile {profile_name} sets {_shown(key, value)} over the node's {_shown(key, old)}"
            notes.append(f"{key}: {shown}")
        to_set[key] = value
    for key, value in upper.items():
        source = "--env" if key in overrides else "the launching shell"
        old = node_env.get(key)
        if old is not None and old != value:
            notes.append(f"{key}: {source} sets its value over the node's {_shown(key, old)}")
        elif key in profile and profile[key] != value:
            theirs = _shown(key, profile[key])
            notes.append(f"{key}: {source} sets its value over profile {profile_name}'s {theirs}")
        to_set[key] = value
    return EnvDecision(to_set=to_set, notes=tuple(notes))


# Ray starts its worker processes at niceness 15 (its `worker_niceness`, so that they yield the CPU to
# the raylet and GCS); torchrun's workers run at the launcher's, 0, and a rank's data-loader workers
# inherit it. The nodes megaray starts itself (a local run's, simulated ones, `megaray up`'s) are
# started with it at 0 (driver/cluster/nodeenv.py), so every worker there, ranks and megaray's helpers alike,
# runs at 0; a cluster started by hand keeps its own (`ray start` with RAY_worker_niceness=0 gives
# the same). A rank removes the variable from its environment (rank/actor.py): torchrun's have none.
NICENESS_VAR = "RAY_worker_niceness"
# On SIGTERM (how `megaray down`, or an `up` interrupted while it starts, stops a node it started),
# Ray 2.60's `ray start --block` first drains its node for up to 30 s, so that Ray Serve's proxies stop
# taking traffic: a node still starting waited all of it and was then killed, a `down` while a job ran
# as long. The nodes megaray starts serve its launches: nothing to drain. A rank drops it too.
DRAIN_VAR = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
NODE_DEFAULTS = {NICENESS_VAR: "0", DRAIN_VAR: "0"}


# Read when a process starts, by the interpreter (PYTHONHASHSEED, PYTHONWARNINGS, PYTHONDEVMODE,
# PYTHONMALLOC, PYTHONPATH, ...), the dynamic loader (LD_PRELOAD, LD_LIBRARY_PATH) or libc (MALLOC_,
# GLIBC_TUNABLES): set in os.environ once the process runs, they do nothing for it.
STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_")
STARTUP_NAMES = frozenset({"GLIBC_TUNABLES"})


def is_startup_var(name: str) -> bool:
    return name.startswith(STARTUP_PREFIXES) or name in STARTUP_NAMES


def startup_env(*, profile: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, str]:
    """The start-up variables among what the launch sets in every rank (`--env`, then the profile;
    the shell's are not forwarded, core/shellenv.py): they must be in the rank process's environment
    when it starts, as under torchrun, so the driver has Ray start the process with them."""
    merged = {**profile, **overrides}
    return {k: merged[k] for k in sorted(merged) if is_startup_var(k)}


def parse_env_pairs(pairs: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`--env KEY=VALUE` (repeatable) into a dict; `--env KEY` forwards this process's value of KEY,
    as `docker run -e KEY` does."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            if environ is None or key not in environ:
                raise ValueError(
                    f"--env {key} forwards this shell's {key}, which is not set: export it, or write "
                    f"--env {key}=VALUE"
                )
            value = environ[key]
        out[key.strip()] = value
    check_user_env(out, "--env")
    return out


def interface_defaults(iface: str | None) -> dict[str, str]:
    """Gloo and NCCL's socket bootstrap pick the address to advertise from the hostname, which often
    resolves to loopback (Ubuntu's 127.0.1.1): ranks on other machines then cannot connect. Name the
    interface that holds the node's Ray IP instead (NCCL's `=` asks for that exact name)."""
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": f"={iface}"} if iface else {}


def decide_envs(
    slots: list[RankSlot],
    gpu_ids: list[tuple[str, ...]],
    node_envs: list[Mapping[str, str]],
    *,
    world_size: int,
    local_world_size: int,
    num_nodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    profile: Mapping[str, str],
    profile_name: str | None,
    overrides: Mapping[str, str],
    forwarded: Mapping[str, str] = {},
    ifaces: list[str | None] | None = None,
) -> list[EnvDecision]:
    """Every rank's env, by rank: the contract (CUDA_VISIBLE_DEVICES from the GPU ids Ray gave the
    node's ranks, in local-rank order), then the precedence of `decide_env`."""
    by_node: dict[int, list[tuple[str, ...]]] = {}
    for s, ids in zip(slots, gpu_ids, strict=True):
        by_node.setdefault(s.node_rank, []).append(ids)
    visible = {n: visible_devices([list(i) for i in ids]) for n, ids in by_node.items()}
    decisions = []
    for s, node_env, iface in zip(slots, node_envs, ifaces or [None] * len(slots), strict=True):
        contract = contract_env(
            s,
            world_size=world_size,
            local_world_size=local_world_size,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=master_port,
            run_id=run_id,
            restart_count=restart_count,
            max_restarts=max_restarts,
            visible_devices=visible[s.node_rank],
        )
        decisions.append(
            decide_env(
                contract,
                node_env=node_env,
                profile=profile,
                profile_name=profile_name,
                overrides=overrides,
                forwarded=forwarded,
                defaults={**DEFAULTS, **interface_defaults(iface)},
            )
        )
    return decisions
