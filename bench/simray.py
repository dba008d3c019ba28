"""A stand-in for Ray under megaray's real driver, for bench/scale_sim.py: thousands of nodes in one
process on this machine.

Ray ships no fake large cluster (`ray.cluster_utils.Cluster` starts a raylet per node), so this
replaces the part of Ray's API the driver calls (`grep -ohE "\\bray\\.[a-zA-Z_.]+" launcher/driver`)
with one that keeps the semantics the driver depends on and charges what Ray charges:

- a synchronous call to the GCS (a placement group created, removed or read, the node table, the
  key-value store, a named actor registered) sleeps `gcs_ms` in the caller and is counted;
- actors become ready no faster than Ray's measured throughput (`actors_per_s`, ~550 a second in
  Ray's `many_actors` release test) and no sooner than a worker process starts (`actor_start_s`);
- an actor runs its calls one at a time, in arrival order (an async actor: on an event loop, all at
  once), each call `call_ms` after it is sent; the output sink in a process of its own, as on a
  cluster (in this one its work would hold the driver's GIL), its calls too run together there;
- each simulated node has a raylet port that answers megaray's liveness probes (a real listening
  socket), so a node can be lost by closing it.

Only what the driver itself runs is megaray's real code: placement decisions, the controller,
supervision, the output sink and the nodes' forwarders, failure reports, teardown. The ranks are
`SimRank`s in place of rank/actor.py (which runs the program in the actor's process).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

# -- refs and time -------------------------------------------------------------------------------------


class Ref:
    """An ObjectRef: set once, by the clock thread, an actor's thread, or the event loop. Whoever
    waits for it is woken by it alone (Ray's wait does not wake the driver for others' results)."""

    __slots__ = ("__weakref__", "_callbacks", "_done", "_error", "_lock", "_value", "_waiters")

    def __init__(self):
        self._done = False
        self._value = self._error = None
        self._callbacks: list[Callable[[Ref], None]] = []
        self._waiters: set[threading.Event] = set()
        self._lock = threading.Lock()

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done:
                return
            self._value, self._error, self._done = value, error, True
            callbacks, self._callbacks = self._callbacks, []
            waiters, self._waiters = self._waiters, set()
        for event in waiters:
            event.set()
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Ref], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(cb)
                return
        cb(self)

    def _watch(self, event: threading.Event) -> bool:
        """Wake `event` when done; whether it is done already."""
        with self._lock:
            if not self._done:
                self._waiters.add(event)
            return self._done

    def _unwatch(self, event: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(event)

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def __await__(self):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(ref: Ref) -> None:
            loop.call_soon_threadsafe(_settle, fut, ref)

        self.add_done_callback(done)
        return fut.__await__()


def _settle(fut: asyncio.Future, ref: Ref) -> None:
    if fut.done():
        return
    if ref._error is not None:
        fut.set_exception(ref._error)
    else:
        fut.set_result(ref._value)


class Sim:
    """The simulated cluster's clock, event loop, nodes and counters."""

    def __init__(self):
        self.cond = threading.Condition()
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.counts: Counter[str] = Counter()
        self.gcs_s = 0.001
        self.call_s = 0.0005
        self.actor_start_s = 0.5
        self.actor_gap_s = 1 / 550
        self.next_actor_at = 0.0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.node_ids: list[str] = []
        self.place_from = 0  # nodes before it are full
        self.listeners: dict[str, socket.socket] = {}
        self.groups: dict[str, SimGroup] = {}
        self.kv: dict[tuple[str | None, str], Any] = {}
        self.loop = asyncio.new_event_loop()
        self.driver_node = "e" * 56  # not one of the simulated nodes (theirs count up from 0)
        self.loop_lags: list[float] = []  # how late the simulation's event loop wakes: its own load
        threading.Thread(target=self.loop.run_forever, name="sim-loop", daemon=True).start()
        self.tasks: set[asyncio.Task] = set()
        self.spawn(self._loop_lag())
        threading.Thread(target=self._clock, name="sim-clock", daemon=True).start()

    def spawn(self, coro: Any) -> None:
        """Runs `coro` on the simulation's loop, holding its task as Ray holds an actor call's: the
        loop holds tasks weakly, and one awaiting a future only it refers to (watch_ends' wait that
        never answers) would be collected mid-call, its caller told GeneratorExit."""

        def start() -> None:
            task = self.loop.create_task(coro)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        self.loop.call_soon_threadsafe(start)

    async def _loop_lag(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.1)
            self.loop_lags.append(time.monotonic() - t - 0.1)

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self.cond:
            heapq.heappush(self.heap, (when, next(self.seq), fn))
            self.cond.notify_all()

    def _clock(self) -> None:
        while True:
            with self.cond:
                while not self.heap or self.heap[0][0] > time.monotonic():
                    self.cond.wait(timeout=(self.heap[0][0] - time.monotonic()) if self.heap else None)
                _, _, fn = heapq.heappop(self.heap)
            fn()

    def gcs(self, what: str) -> None:
        """A synchronous round trip to the GCS."""
        self.counts["sync:" + what] += 1
        time.sleep(self.gcs_s)

    def add_nodes(self, n: int, resources: dict[str, float]) -> None:
        for i in range(n):
            node_id = f"{i:056x}"
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            self.listeners[node_id] = listener
            ip = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
            self.node_ids.append(node_id)
            self.nodes[node_id] = {
                "NodeID": node_id, "Alive": True, "NodeManagerAddress": ip,
                "NodeManagerHostname": f"node{i}", "NodeManagerPort": listener.getsockname()[1],
                "Resources": dict(resources), "free": dict(resources), "probe": listener.getsockname(),
            }  # fmt: skip
        threading.Thread(target=self._accept, name="sim-raylets", daemon=True).start()

    def _accept(self) -> None:
        """Every raylet port answers: connections are accepted and closed."""
        import selectors

        sel = selectors.DefaultSelector()
        for s in self.listeners.values():
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select(timeout=0.5):
                try:
                    conn, _ = key.fileobj.accept()
                    conn.close()
                except OSError:
                    pass

    def lose_node(self, node_id: str) -> None:
        """The machine is gone: its raylet stops answering, its actors die when Ray notices."""
        self.listeners[node_id].close()
        self.nodes[node_id]["Alive"] = False


SIM = Sim()


# -- the API the driver calls ---------------------------------------------------------------------------


def get(refs: Any, timeout: float | None = None) -> Any:
    single = isinstance(refs, Ref)
    items = [refs] if single else list(refs)
    _, pending = wait(items, num_returns=len(items), timeout=timeout)
    if pending:
        raise ray.exceptions.GetTimeoutError("sim: get timed out")
    values = [r.result() for r in items]
    return values[0] if single else values


def wait(refs: list, *, num_returns: int = 1, timeout: float | None = None, **_: Any) -> tuple[list, list]:
    deadline = None if timeout is None else time.monotonic() + timeout
    event = threading.Event()
    watched = [r for r in refs if not r._watch(event)]
    try:
        while True:
            done = sum(r._done for r in refs)
            left = None if deadline is None else deadline - time.monotonic()
            if done >= num_returns or (left is not None and left <= 0):
                break
            event.wait(timeout=left)
            event.clear()
    finally:
        for r in watched:
            r._unwatch(event)
    ready = [r for r in refs if r._done][:num_returns]
    chosen = set(map(id, ready))
    return ready, [r for r in refs if id(r) not in chosen]


def kill(actor: Any, no_restart: bool = True) -> None:
    SIM.counts["async:kill"] += 1
    actor._kill()


def nodes() -> list[dict[str, Any]]:
    SIM.gcs("nodes")
    return [dict(n) for n in SIM.nodes.values()]


class RuntimeContext:
    gcs_address = "127.0.0.1:6379"

    def get_node_id(self) -> str:
        return SIM.driver_node

    def get_job_id(self) -> str:
        return "01000000"


def get_runtime_context() -> RuntimeContext:
    return RuntimeContext()


def remote(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and not kwargs and callable(args[0]):
        return _remote(args[0], {})
    return lambda target: _remote(target, kwargs)


def _remote(target: Any, opts: dict[str, Any]) -> Any:
    if isinstance(target, type):
        return ActorClass(target, opts)
    return RemoteFunction(target)


# -- actors -----------------------------------------------------------------------------------------


class ActorClass:
    def __init__(self, cls: type, opts: dict[str, Any]):
        self.cls, self.opts = cls, opts

    def options(self, **opts: Any) -> ActorClass:
        return ActorClass(self.cls, {**self.opts, **opts})

    def remote(self, *args: Any, **kwargs: Any) -> Actor:
        if self.opts.get("name"):
            SIM.gcs("register a named actor")  # Ray registers the name before .remote() returns
        SIM.counts["async:create actor"] += 1
        return Actor(self.cls, args, kwargs, self.opts)


def _node_of(opts: dict[str, Any]) -> str:
    strategy = opts.get("scheduling_strategy")
    if strategy is None:
        return SIM.driver_node
    group = getattr(strategy, "placement_group", None)
    if group is not None:
        return group.node
    return strategy.node_id


class Actor:
    """An actor handle; the instance is made when its worker "starts". Serial actors run their calls
    on a thread of their own; async ones on the simulation's event loop."""

    def __init__(self, cls: type, args: tuple, kwargs: dict, opts: dict[str, Any]):
        self._cls, self._node = cls, _node_of(opts)
        self._async = cls.__name__ not in OWN_PROCESS and any(
            asyncio.iscoroutinefunction(getattr(cls, m, None)) for m in dir(cls) if not m.startswith("_")
        )  # one in a process of its own is called as a serial one, from a thread
        self._inline = issubclass(cls, SimRank)  # its calls are trivial: run on the clock's thread
        self._ready = Ref()
        self._dead: BaseException | None = None
        self._queue: list[tuple[str, tuple, Ref]] = []
        self._lock = threading.Lock()
        self._busy = False
        self._instance: Any = None
        now = time.monotonic()
        when = max(now + SIM.actor_start_s, SIM.next_actor_at + SIM.actor_gap_s)
        SIM.next_actor_at = when
        SIM.at(when, lambda: self._start(args, kwargs))

    def _start(self, args: tuple, kwargs: dict) -> None:
        if self._dead is not None:
            return
        if not SIM.nodes.get(self._node, {"Alive": True})["Alive"]:
            self._die(ray.exceptions.ActorDiedError())
            return
        try:
            if self._cls.__name__ in OWN_PROCESS:
                self._instance = ProcessProxy(self._cls, args, kwargs)
            else:
                self._instance = self._cls(*args, **kwargs)
        except BaseException as e:
            self._die(e)
            return
        if isinstance(self._instance, SimRank):
            self._instance.handle = self
        self._ready.set(True)
        self._pump()

    def __getattr__(self, name: str) -> Method:
        if name.startswith("_") and name not in ("__ray_terminate__", "__ray_ready__"):
            raise AttributeError(name)
        return Method(self, name)

    def _call(self, name: str, args: tuple, kwargs: dict) -> Ref:
        ref = Ref()
        if self._dead is not None:
            ref.set(error=self._dead)
            return ref
        with self._lock:
            self._queue.append((name, (args, kwargs), ref))
        if self._ready._done:
            SIM.at(time.monotonic() + SIM.call_s, self._pump)
        return ref

    def _pump(self) -> None:
        """Runs the queued calls: a serial actor one at a time on a thread; an async one on the loop."""
        with self._lock:
            if self._busy or not self._queue:
                return
            self._busy = True
        if self._async:
            while True:
                with self._lock:
                    if not self._queue:
                        self._busy = False
                        return
                    name, args, ref = self._queue.pop(0)
                SIM.spawn(self._run_async(name, args, ref))
        if self._inline:
            self._drain()
        else:
            threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._dead is not None:
                    self._busy = False
                    dead, queue = self._dead, self._queue
                    self._queue = []
                    break
                name, args, ref = self._queue.pop(0)
            self._run(name, args, ref)
        for _, _, ref in queue:
            ref.set(error=dead)

    def _run(self, name: str, args: tuple, ref: Ref) -> None:
        if name in ("__ray_terminate__", "leave"):  # a rank's `leave` ends in exit_actor()
            ref.set(None)
            return self._die(ray.exceptions.ActorDiedError())
        if name == "__ray_ready__":
            return ref.set(True)
        try:
            result = getattr(self._instance, name)(*args[0], **args[1])
        except BaseException as e:
            return ref.set(error=ray.exceptions.RayTaskError(name, str(e), e))
        if isinstance(result, Ref):  # a SimRank's run: it ends later
            result.add_done_callback(lambda r: ref.set(r._value, r._error))
        else:
            ref.set(result)

    async def _run_async(self, name: str, args: tuple, ref: Ref) -> None:
        if name in ("__ray_terminate__", "__ray_ready__"):
            return self._run(name, args, ref)
        if (fake := ON_NODE.get(name)) is not None:  # the ranks' processes are made up: never looked at
            return ref.set(fake(*args[0], **args[1]))
        try:
            ref.set(await getattr(self._instance, name)(*args[0], **args[1]))
        except BaseException as e:
            ref.set(error=ray.exceptions.RayTaskError(name, str(e), e))

    def _kill(self) -> None:
        self._die(ray.exceptions.ActorDiedError())

    def _die(self, error: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = error
        self._ready.set(error=error)
        if isinstance(self._instance, SimRank):
            self._instance.died(error)
        with self._lock:
            queue, self._queue = self._queue, []
        for _, _, ref in queue:
            ref.set(error=error)


# actors whose work would hold the driver's GIL here, unlike on a cluster: the sink, held by the
# driver's node's forwarder (here no simulated node is the driver's: it forwards no rank's output)
OWN_PROCESS = {"SinkForwarder"}


class ProcessProxy:
    """An actor's instance in a process of its own: each call is sent there at once and answered
    when it ends (a Ref), so that its calls run together on its event loop, as Ray runs an async
    actor's: the driver's long-poll drain waits there while the nodes' batches keep coming."""

    def __init__(self, cls: type, args: tuple, kwargs: dict):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, cls, args, kwargs), daemon=True)
        self.process.start()
        error = self.conn.recv()
        if error is not None:
            raise error
        self.ids = itertools.count()
        self.waiting: dict[int, tuple[str, Ref]] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._answers, daemon=True).start()

    def _answers(self) -> None:
        while True:
            try:
                call, ok, value = self.conn.recv()
            except (EOFError, OSError):
                return
            with self.lock:
                name, ref = self.waiting.pop(call)
            if ok:
                ref.set(value)
            else:
                ref.set(error=ray.exceptions.RayTaskError(name, str(value), value))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Ref:
            ref = Ref()
            with self.lock:
                call_id = next(self.ids)
                self.waiting[call_id] = (name, ref)
                self.conn.send((call_id, name, args, kwargs))
            return ref

        return call


def _serve(conn: Any, cls: type, args: tuple, kwargs: dict) -> None:
    try:
        instance = cls(*args, **kwargs)
    except BaseException as e:
        conn.send(e)
        return
    conn.send(None)
    loop = asyncio.new_event_loop()  # an async actor's methods, started in the order they came
    threading.Thread(target=loop.run_forever, daemon=True).start()
    sending = threading.Lock()

    async def run(call_id: int, name: str, a: tuple, kw: dict) -> None:
        try:
            value = getattr(instance, name)(*a, **kw)
            answer = (call_id, True, await value if asyncio.iscoroutine(value) else value)
        except BaseException as e:
            answer = (call_id, False, e)
        with sending:
            conn.send(answer)

    while True:
        try:
            call_id, name, a, kw = conn.recv()
        except EOFError:
            return
        asyncio.run_coroutine_threadsafe(run(call_id, name, a, kw), loop)


class Method:
    def __init__(self, actor: Actor, name: str):
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        return self.actor._call(self.name, args, kwargs)


# -- tasks --------------------------------------------------------------------------------------------

TASKS: dict[str, Callable[..., Any]] = {}  # what a task does in the simulation, by function name


class RemoteFunction:
    def __init__(self, fn: Callable, opts: dict[str, Any] | None = None):
        self.fn, self.opts = fn, opts or {}

    def options(self, **opts: Any) -> RemoteFunction:
        return RemoteFunction(self.fn, {**self.opts, **opts})

    def remote(self, *args: Any) -> Ref:
        SIM.counts["async:task " + self.fn.__name__] += 1
        ref = Ref()
        node = SIM.nodes.get(_node_of(self.opts), {"Alive": True})
        fake = TASKS[self.fn.__name__]

        def run() -> None:
            if not node["Alive"]:
                return  # a task on a lost node never answers
            try:
                ref.set(fake(*args))
            except BaseException as e:
                ref.set(error=ray.exceptions.RayTaskError(self.fn.__name__, str(e), e))

        SIM.at(time.monotonic() + SIM.actor_start_s, run)  # a task waits for a worker too
        return ref


def _exit_and_ship(procs: list, grace_s: float, sink: Any, spools: list, marks: list) -> list:
    return [(0.01, True, 0)] * len(procs)


def _ship(sink: Any, spools: list, delete: bool) -> dict[str, Any]:
    return {"shipped": {}, "oom_kills": 0}


TASKS.update({"exit_and_ship": _exit_and_ship, "ship": _ship})
# what a node's forwarder does to the node's rank processes (rank/forwarder.py), faked as the tasks
# are: a SimRank's pid is made up, and may be another process's on this machine
ON_NODE: dict[str, Callable[..., Any]] = {
    "exit_and_ship": lambda ps, grace_s, spools, marks: _exit_and_ship(ps, grace_s, None, spools, marks),
    "exit_marked": lambda mark: False,
    "inspect": lambda procs: [{"pid": p.pid, "state": "gone", "stack": None, "how": None} for p in procs],
}


# -- placement groups ---------------------------------------------------------------------------------


class SimGroup:
    """A STRICT_PACK group: placed on the first node with room, in creation order (as Ray's GCS
    would, it does not keep two groups apart)."""

    def __init__(self, bundles: list[dict[str, float]], name: str, selector: list | None):
        self.name, self.bundles = name, bundles
        self.id = _Id(f"{next(SIM.seq):032x}")
        self.node: str | None = None
        self.state = "PENDING"
        self.excluded: set[str] = set()
        if selector:
            text = selector[0]["ray.io/node-id"]
            self.excluded = set(text[len("!in(") : -1].split(","))
        self._ready = Ref()
        SIM.groups[self.id.hex()] = self
        SIM.at(time.monotonic() + SIM.gcs_s, self._place)

    def _place(self) -> None:
        need: Counter[str] = Counter()
        for b in self.bundles:
            need.update(b)
        ids = SIM.node_ids
        i = SIM.place_from
        while i < len(ids) and not _fits(SIM.nodes[ids[i]]["free"], need):  # full nodes stay full
            i += 1
        SIM.place_from = i  # until a group is removed: the GCS's own scan is not what is measured
        for node_id in ids[i:]:
            node = SIM.nodes[node_id]
            if node["Alive"] and node_id not in self.excluded and _fits(node["free"], need):
                for k, v in need.items():
                    node["free"][k] -= v
                self.node, self.state = node_id, "CREATED"
                self._ready.set(True)
                return

    def ready(self) -> Ref:
        return self._ready

    def remove(self) -> None:
        if self.node is not None and self.state == "CREATED":
            need: Counter[str] = Counter()
            for b in self.bundles:
                need.update(b)
            for k, v in need.items():
                SIM.nodes[self.node]["free"][k] += v
            SIM.place_from = 0
        self.state = "REMOVED"


def _fits(free: dict[str, float], need: Counter[str]) -> bool:
    return all(free.get(k, 0) >= v for k, v in need.items())


class _Id:
    def __init__(self, text: str):
        self.text = text

    def hex(self) -> str:
        return self.text


def placement_group(
    bundles: list, strategy: str = "STRICT_PACK", name: str = "", bundle_label_selector: list | None = None,
    lifetime: str | None = None,
) -> SimGroup:  # fmt: skip
    SIM.gcs("create a placement group")
    return SimGroup(bundles, name, bundle_label_selector)


def placement_group_table(group: SimGroup | None = None) -> dict[str, Any]:
    SIM.gcs("placement group table")

    def row(g: SimGroup) -> dict[str, Any]:
        return {
            "name": g.name,
            "state": g.state,
            "bundles_to_node_id": dict.fromkeys(range(len(g.bundles)), g.node),
        }

    if group is not None:
        return row(group)
    return {gid: row(g) for gid, g in SIM.groups.items()}


def remove_placement_group(group: SimGroup) -> None:
    SIM.gcs("remove a placement group")
    group.remove()


# -- the private calls (driver/cluster/rayprivate.py) ------------------------------------------------


def kv_get(key: str, namespace: str | None = None) -> Any:
    SIM.gcs("kv")
    return SIM.kv.get((namespace, key))


def kv_put(key: str, value: str, *, overwrite: bool, namespace: str) -> bool:
    SIM.gcs("kv")
    existed = (namespace, key) in SIM.kv
    if overwrite or not existed:
        SIM.kv[(namespace, key)] = value
    return existed


def kv_del(key: str, namespace: str) -> None:
    SIM.gcs("kv")
    SIM.kv.pop((namespace, key), None)


def total_resources_per_node() -> dict[str, dict[str, float]]:
    SIM.gcs("resources")
    return {n: dict(v["Resources"]) for n, v in SIM.nodes.items() if v["Alive"]}


def available_resources_per_node() -> dict[str, dict[str, float]]:
    SIM.gcs("resources")
    return {n: dict(v["free"]) for n, v in SIM.nodes.items() if v["Alive"]}


# -- the ranks ----------------------------------------------------------------------------------------


class SimRank:
    """A rank's actor (rank/actor.py's calls), whose program prints `lines_per_s` lines to its node's
    forwarder for `run_s` and returns; or fails as `fail` says."""

    lines_per_s = 1.0
    run_s = 10.0
    fail: Callable[[SimRank], str | None] = staticmethod(lambda rank: None)  # "raise" | "die" | None

    def __init__(self, job: str, rank: int, node_ip: str, pooled: Any = None):
        self.job, self.rank, self.node_ip = job, rank, node_ip
        self.handle: Actor | None = None
        self.forwarder: Any = None
        self.stopped = asyncio.Event()
        self.run_ref: Ref | None = None

    def info(self) -> Any:
        from launcher.core.topology import RankReport
        from launcher.core.versions import python_version

        node = SIM.nodes[self.handle._node]
        return RankReport(
            rank=self.rank, node_ip=node["NodeManagerAddress"], node_id=node["NodeID"],
            hostname=node["NodeManagerHostname"], pid=100_000 + self.rank, gpu_ids=(str(self.rank % 8),),
            ray_version=ray.__version__, python_version=python_version(), inherited_env={},
            iface="eth0", log_dir="/tmp/ray/session_latest/logs", oom_kills=0,
        )  # fmt: skip

    def free_ports(self, seed: str, count: int, exact: int | None = None) -> list[int]:
        return [exact] if exact is not None else list(range(29500, 29500 + count))

    def open_rendezvous(self, port: int) -> None:
        pass

    def close_rendezvous(self) -> None:
        pass

    def reach(self, host: str, port: int, timeout_s: float) -> str | None:
        return None

    def setup(
        self, env: dict[str, str], sink: Any = None, *rest: Any, **kwargs: Any
    ) -> tuple[dict[str, str], str | None]:
        self.forwarder = sink._instance if isinstance(sink, Actor) else None
        return dict(env), None

    def run(self, runner: Any, target: Any, cwd: str) -> Ref:
        self.run_ref = Ref()
        SIM.spawn(self._program())
        return self.run_ref

    async def _program(self) -> None:
        from launcher.core.errors import FailureKind
        from launcher.core.outbatch import Source
        from launcher.core.outcome import RankOutcome

        t0, made, offset = time.monotonic(), 0, 0
        fails, fail_at = SimRank.fail(self), t0 + SimRank.run_s / 2
        stop_wait = asyncio.ensure_future(self._stop_wait())
        while time.monotonic() - t0 < SimRank.run_s:
            await asyncio.sleep(max(0.03, 1 / SimRank.lines_per_s))
            if self.run_ref._done:
                return
            if fails and time.monotonic() >= fail_at:
                break
            due = int((time.monotonic() - t0) * SimRank.lines_per_s)
            if due > made and self.forwarder is not None:
                stamp = f"t={time.time():.3f} "  # the console's lag is measured from it
                data = b"".join(f"{stamp if i == made else ''}step {i} of rank {self.rank}\n".encode()
                                for i in range(made, due))  # fmt: skip
                made = due
                await self.forwarder.write(Source(self.rank), data, offset)
                offset += len(data)
        stop_wait.cancel()
        if fails == "die":
            self.handle._die(ray.exceptions.ActorDiedError())
        elif fails == "raise":
            self.run_ref.set(
                RankOutcome(
                    ok=False,
                    kind=FailureKind.EXCEPTION,
                    summary="RuntimeError: simulated",
                    exit_code=1,
                    traceback="Traceback (most recent call last):\nRuntimeError: simulated\n",
                    at=time.time(),
                )
            )
        else:
            self.run_ref.set(RankOutcome(ok=True))

    async def _stop_wait(self) -> None:
        """The driver's stop (rank/capture.py): SIGTERM ends the process."""
        if self.forwarder is None:
            return
        await self.forwarder.wait_stop()
        self.handle._die(ray.exceptions.ActorDiedError())

    def died(self, error: BaseException) -> None:
        if self.run_ref is not None:
            self.run_ref.set(error=error)


def install() -> None:
    """Put the stand-in under megaray's driver (its modules hold `ray` and a few names of it)."""
    import launcher.driver.cluster.rayprivate as rayprivate
    import launcher.driver.gang.actors as actors
    import launcher.driver.gang.gang as gang
    import launcher.driver.gang.placement as placement
    import launcher.driver.gang.spares as spares
    import launcher.driver.supervision.rank_ends as rank_ends

    api = {"get": get, "wait": wait, "kill": kill, "nodes": nodes, "remote": remote,
           "get_runtime_context": get_runtime_context, "is_initialized": lambda: True}  # fmt: skip
    for name, fn in api.items():
        setattr(ray, name, fn)
    for module in (placement,):
        module.placement_group = placement_group
        module.placement_group_table = placement_group_table
        module.remove_placement_group = remove_placement_group
    spares.placement_group_table = placement_group_table
    for name in ("kv_get", "kv_put", "kv_del", "total_resources_per_node", "available_resources_per_node"):
        setattr(rayprivate, name, globals()[name])
    rayprivate.autoscaling_status = lambda: None
    rayprivate.show_worker_logs = lambda on: None
    actors._rank_actor_class.cache_clear()
    actors._rank_actor_class = lambda: ActorClass(SimRank, {})
    # the raylets' addresses as megaray probes them: the simulated nodes' IPs are not this machine's
    gang.raylet_addresses = _raylet_addresses
    rank_ends.node_lost = _node_lost


def _raylet_addresses(node_ids: set[str]) -> dict[str, tuple[str, int]]:
    SIM.gcs("nodes")
    return {n: SIM.nodes[n]["probe"] for n in node_ids}


def _node_lost(node_id: str) -> bool:
    SIM.gcs("nodes")
    node = SIM.nodes.get(node_id)
    if node is None or not node["Alive"]:
        return True
    try:
        with socket.create_connection(node["probe"], timeout=0.5):
            return False
    except OSError:
        return True
