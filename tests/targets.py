"""Programs the tests launch on every rank. Each writes what it saw to $MEGARAY_TEST_OUT."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SEEN = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "FI_PROVIDER", "NCCL_DEBUG", "NCCL_BUFFSIZE",
    "MEGARAY_TEST_FLAG", "PWD", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
)  # fmt: skip


def _out(name: str) -> Path:
    out = Path(os.environ["MEGARAY_TEST_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}-rank{os.environ['RANK']}.json"


def _write(name: str, data: dict) -> None:
    path = _out(name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def dump_env():
    """Record the env contract, what Ray assigned, and which heavy libraries were imported before us
    (torch, pyarrow, pydantic: none). Rank 0 then imports pyarrow and records whether Ray's serializer
    for its tables is registered in this process, as Ray registers it (rank/serialization.py)."""
    import ray

    preloaded = sorted(m for m in ("torch", "pyarrow", "pydantic") if m in sys.modules)
    arrow_registered = None
    if os.environ["RANK"] == "0":
        from importlib.util import find_spec

        if find_spec("pyarrow") is not None:
            import pyarrow
            from ray import cloudpickle

            arrow_registered = pyarrow.Table in cloudpickle.CloudPickler.dispatch
    _write(
        "env",
        {
            "env": {k: os.environ.get(k) for k in SEEN},
            "ray_gpu_ids": [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])],
            "node_id": ray.get_runtime_context().get_node_id(),
            "argv": sys.argv,
            "preloaded": preloaded,
            "arrow_registered": arrow_registered,
            "pid": os.getpid(),
            "cwd": os.getcwd(),
        },
    )
    return int(os.environ["RANK"])


def gloo_allreduce():
    """A real torchrun-style program: join the group from env://, all-reduce the ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    _write("allreduce", {"sum": t.item(), "port": os.environ["MASTER_PORT"]})
    return t.item()


def fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses on purpose")
    time.sleep(60)


class _CaughtWhenRead:
    """An exception's message that marks, when read, that the rank has caught the failure: megaray's
    rank reads a message only after it took the failure as the program's own (rank/actor.py
    `_caught`), so a rank that waits for the mark knows its peer failed before any stop."""

    def __init__(self, mark: Path):
        self.mark = mark

    def __str__(self) -> str:
        self.mark.touch()
        return "bad batch"


def fail_together():
    """Every rank raises, but the word of ranks 1.. comes late: each printed a burst, which the rank
    sends the driver before its result (the pace of a loaded machine, or of a long traceback). The
    bursts go before a file barrier: written after it, on a loaded machine, a rank was still writing
    its burst when the stop began, and was rightly not listed as failed. Rank 0 raises once the others
    have caught their failures: on a loaded machine one of them, descheduled between the barrier and
    its raise, could otherwise still be running when the stop came, and rightly not be listed."""
    out, world, rank = _out("barrier").parent, int(os.environ["WORLD_SIZE"]), os.environ["RANK"]
    if rank != "0":
        sys.stdout.write("".join(f"burst line {i} " + "x" * 60 + "\n" for i in range(20000)))
        sys.stdout.flush()
    (out / f"ready-{rank}").touch()
    while len(list(out.glob("ready-*"))) < world:
        time.sleep(0.005)
    if rank != "0":
        raise ValueError(_CaughtWhenRead(out / f"caught-{rank}"))
    deadline = time.monotonic() + 60
    while len(list(out.glob("caught-*"))) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    raise ValueError("bad batch")


def exit_3_on_rank_0():
    if os.environ["RANK"] == "0":
        sys.exit(3)
    time.sleep(60)


def exit_with_a_message():
    sys.exit("bad config: lr must be positive")


def wait_forever():
    """Report the pid and block: the test kills or interrupts from outside."""
    _write("pid", {"pid": os.getpid()})
    time.sleep(600)


def wait_forever_with_a_child():
    """As a rank with DataLoader workers: it forks a child, which holds the rank's sockets (Ray's own
    among them) until its parent is gone and for CHILD_HOLDS_S after, then says so and exits; Ray
    learns of the rank's death only when the child lets go. Each rank reports its pid and its child's."""
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        while os.getppid() == parent:
            time.sleep(0.05)
        time.sleep(CHILD_HOLDS_S)
        _write("let-go", {"pid": os.getpid()})
        os._exit(0)
    _write("child", {"pid": child})
    wait_forever()


# How long the child of `wait_forever_with_a_child` holds its dead parent's sockets.
CHILD_HOLDS_S = 60.0


def save_on_sigterm():
    """As a program that saves a checkpoint when preempted: SIGTERM takes it 2 s to save, then exit."""
    import signal

    def save(signum, _frame):
        time.sleep(2)
        _write("saved", {"signal": signum})
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, save)
    wait_forever()


def dump_profile():
    """Every variable of the rank's environment, to compare with a profile."""
    _write("profile", dict(os.environ))


def whoami(tag=None):
    """For rank groups: which actor answered, and the env contract it carries."""
    import ray

    return {"rank": int(os.environ["RANK"]), "actor": ray.get_runtime_context().get_actor_id(), "tag": tag,
            "local_rank": int(os.environ["LOCAL_RANK"]), "world": int(os.environ["WORLD_SIZE"])}  # fmt: skip


def item_and_rank(item):
    return {"item": item, "rank": int(os.environ["RANK"])}


def _hold_the_gil(seconds: float) -> None:
    """One C call that keeps the GIL for about `seconds` (a builtin sum over a range)."""
    t = time.perf_counter()
    sum(range(1_000_000))
    per_item = (time.perf_counter() - t) / 1_000_000
    sum(range(int(seconds / per_item)))


def _write_a_checkpoint(path: Path, seconds: float, cap: int = 512 << 20) -> None:
    """Write and fsync for `seconds` (at most `cap` bytes), as a long checkpoint save does."""
    chunk, written, end = os.urandom(16 << 20), 0, time.monotonic() + seconds
    with path.open("wb") as f:
        while time.monotonic() < end and written < cap:
            f.write(chunk)
            os.fsync(f.fileno())
            written += len(chunk)
    path.unlink()


def _first_compile(cache: Path) -> float:
    """torch.compile's first compile of a small function, with an empty cache: inductor writes C++ and
    builds it with the node's compiler (about 30 s of it on this 2-core machine). Its seconds."""
    import torch

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # read when inductor first needs it

    @torch.compile
    def step(x):
        return (x.sin() * x.cos()).softmax(-1) @ x.T

    t = time.monotonic()
    step(torch.randn(64, 64))
    return time.monotonic() - t


def busy_then_frozen():
    """What is not a lost node, each for longer than megaray's probes allow a node to stay silent
    (core/liveness.py), and nothing here is silent to them: for 6 s the machine at 100%, rank 0 busy in
    the interpreter (not in any wait) and rank 1 in one C call holding the GIL; then each compiling with
    torch.compile for the first time (where the node has a C++ compiler: inductor needs one); then rank
    1 stopped (SIGSTOP) for 6 s by rank 0, which writes a checkpoint meanwhile, then lets it go
    (SIGCONT). (Both ranks used to go through each in turn: the same conditions, 10 s longer.)"""
    import shutil
    import signal

    out = Path(os.environ["MEGARAY_TEST_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    if rank == 0:
        end = time.monotonic() + 6
        while time.monotonic() < end:  # the interpreter busy, not in any wait
            sum(i * i for i in range(10_000))
    else:
        _hold_the_gil(6)
    if shutil.which("g++") or shutil.which("c++"):
        (out / f"compiled-{rank}").write_text(f"{_first_compile(out / f'inductor-{rank}'):.1f}")
    let_go = out / "let-go"
    if rank == 1:
        (out / "frozen-pid").write_text(str(os.getpid()))
        while not let_go.exists():  # stopped in here by rank 0, for 6 s
            time.sleep(0.05)
    else:
        pid_file = out / "frozen-pid"
        while not pid_file.exists():
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _write_a_checkpoint(out / "checkpoint-0.bin", 6)  # ends sooner at its cap on a fast disk
        time.sleep(max(0.0, stopped + 6 - time.monotonic()))
        os.kill(pid, signal.SIGCONT)
        let_go.touch()
    return rank
