"""The watch agent: one process per node, outside every replica, holding each one to the grant the
broker gave it.

The watchdog must take its grants from somewhere the watched process cannot write. Code in a
model runs as the replica's user, so a pipe from the replica, or a file the broker writes, can be
written by the model too. The agent is a Ray actor per node (``gpubroker-watch-<node>``, in the
broker's namespace, started by the first replica on the node, detached); it pulls every grant
from the broker actor itself (``BrokerClient.settings``) and nothing else gives it a number:

- a replica registers its pid before its model loads; the agent takes a pid's registration once
  (a later one is refused, so code in the model cannot re-register its replica as another model)
  and only for a pid that Ray's GCS lists as a live Serve replica on this node of that model's
  deployment (``<model>`` or ``<model>@<card>``);
- the grant it watches is the broker's grant for (model, card) over the replica's share of it
  (``GrantBook``): at most the model's whole grant on that card, whatever the replica says;
- a replica's nudge (its grant changed) makes the agent pull from the broker at once; it carries
  no number.

Per pid the agent runs ``PidWatch`` (``gpubroker.deployments.enforce.watch``: the same pure decision as
the replica's own watcher) every ``WATCH_PERIOD_S``, ends the pid past the drain + backstop, and
owns its memory cgroup (``gpubroker.deployments.enforce.cgroup``), whose limit follows the broker's grant.
One process per node instead of one Ray driver per replica (a driver in each watchdog would cost
a core worker, its memory and a job per replica). docs/ENFORCEMENT.md says what is held and by whom.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gpubroker.broker.control.violation import (
    WATCH_PERIOD_S,
    WATCH_SLACK_BYTES,
    GrantHold,
    Verdict,
    WatchLimits,
    watched_grant,
)
from gpubroker.deployments.enforce.watch import (
    PidWatch,
    end_pid,
    host_used_bytes,
    outside_limits,
    remove_cgroup,
    setup_cgroup,
    used_reader,
)

logger = logging.getLogger("ray.serve")

AGENT_PREFIX = "gpubroker-watch-"  # + the node id's first 16 hex digits
POLL_S = 1.0  # how often the agent pulls the grants from the broker (a nudge pulls at once)
REGISTER_TIMEOUT_S = 60.0  # the first replica on a node waits for the agent's process to start


@dataclass(frozen=True)
class Registration:
    """A replica as registered, once, before its model loads."""

    model: str
    card_id: str  # "" in a one-card fleet
    card_replicas: int  # replicas of the model sharing its grant on this card
    pid: int
    device: str  # cpu, cuda:N
    baseline_bytes: int  # what the process held before the model (cpu: at most its RSS at registration)

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.card_id


def serves(deployment: str, model: str, card_id: str) -> bool:
    """Whether Serve deployment ``deployment`` runs ``model`` on ``card_id`` (``<model>`` or
    ``<model>@<card>``: ``gpubroker.deployments.serve.placement_resources.deployment_name``)."""
    return deployment == model or (bool(card_id) and deployment == f"{model}@{card_id}")


@dataclass
class GrantBook:
    """Who is watched and what the broker granted: registrations taken once per pid, checked
    against the pid's owner; grants only from the broker. No Ray, no clock: ``now_s`` is given."""

    hold_s: float  # a lowered grant binds after this long (``violation.lowered_grant_hold_s``)
    watched: dict[int, Registration] = field(default_factory=dict)
    grants: dict[tuple[str, str], int] = field(default_factory=dict)  # the broker's, per (model, card)
    holds: dict[int, GrantHold] = field(default_factory=dict)

    def register(self, reg: Registration, owner: str | None) -> str:
        """Take ``reg`` ("") or say why not. ``owner``: the Serve deployment GCS lists for the pid
        on this node (None: no live Serve replica there)."""
        if reg.pid in self.watched:
            had = self.watched[reg.pid]
            return f"pid {reg.pid} is registered as model '{had.model}': a replica registers once, before its model"
        if owner is None:
            return f"pid {reg.pid} is no live Serve replica on this node"
        if not serves(owner, reg.model, reg.card_id):
            return f"pid {reg.pid} is a replica of deployment '{owner}', not of model '{reg.model}'"
        if reg.card_replicas < 1:
            return f"card_replicas must be >= 1, got {reg.card_replicas}"
        self.watched[reg.pid] = reg
        return ""

    def set_grant(self, model: str, card_id: str, grant_bytes: int) -> None:
        """The broker's grant for the model on the card (the only way a grant enters the book)."""
        self.grants[(model, card_id)] = int(grant_bytes)

    def keys(self) -> set[tuple[str, str]]:
        return {reg.key for reg in self.watched.values()}

    def limits(self, pid: int, now_s: float) -> WatchLimits | None:
        """The limits the pid is held to now: its share of the broker's grant (a lowered one held
        for ``hold_s``); None before the broker's first answer for its model."""
        reg = self.watched.get(pid)
        grant = None if reg is None else self.grants.get(reg.key)
        if reg is None or grant is None:
            return None
        share = max(1, grant // reg.card_replicas)
        watched, self.holds[pid] = watched_grant(self.holds.get(pid, GrantHold()), share, now_s, self.hold_s)
        return outside_limits(WatchLimits(watched, WATCH_SLACK_BYTES))

    def forget(self, pid: int) -> None:
        self.watched.pop(pid, None)
        self.holds.pop(pid, None)


def serve_replica_of(pid: int, node_id: str) -> str | None:
    """The Serve deployment whose live replica actor runs as ``pid`` on ``node_id``, from Ray's GCS
    actor table; None when there is none. The public state API (``ray.util.state``) needs the
    dashboard, which fleets may run without, so this reads the table the GCS client keeps."""
    from ray._private import state  # the GCS actor table (public state API: dashboard only)

    for actor in state.actors().values():
        if actor.get("Pid") != pid or actor.get("State") != "ALIVE":
            continue
        if actor.get("Address", {}).get("NodeID") != node_id:
            continue
        cls = str(actor.get("ActorClassName", ""))  # ServeReplica:<app>:<deployment>
        if cls.startswith("ServeReplica:"):
            return cls.split(":", 2)[2]
    return None


@dataclass
class Watched:
    """One pid under the agent: its watch and its cgroup."""

    watch: PidWatch
    cgroup: Any = None  # ReplicaCgroup, or None (``why_not``)
    why_not: str = ""
    limits: WatchLimits | None = None  # as last applied (the cgroup limit follows it)
    ended_by_agent: bool = False


class WatchAgent:
    """The Ray actor (async): ``register`` a replica, ``nudge`` a pull, ``report`` what it holds."""

    def __init__(self, broker_name: str, namespace: str, node_id: str, hold_s: float):
        self.broker_name, self.namespace, self.node_id = broker_name, namespace, node_id
        self.book = GrantBook(hold_s)
        self.pids: dict[int, Watched] = {}
        self.ended: list[dict[str, Any]] = []  # one entry per pid gone: who ended it, its bound
        self._client: Any = None
        self._loops: list[asyncio.Task] = []
        self._pull_now = asyncio.Event()

    def _log(self, msg: str) -> None:
        logger.warning("gpubroker watchdog: %s", msg)

    def _ensure_loops(self) -> None:
        if not self._loops:
            loop = asyncio.get_running_loop()
            self._loops = [loop.create_task(self._watch_loop()), loop.create_task(self._pull_loop())]

    async def register(
        self, model: str, card_id: str, card_replicas: int, pid: int, device: str, baseline_bytes: int
    ) -> dict[str, Any]:
        """Watch ``pid`` (taken once, checked against GCS); returns accepted/why and its cgroup."""
        self._ensure_loops()
        rss = host_used_bytes(pid, 0)
        if device == "cpu" and rss is not None:
            baseline_bytes = min(int(baseline_bytes), rss)  # never above what the agent reads now
        reg = Registration(model, card_id, int(card_replicas), int(pid), device, int(baseline_bytes))
        owner = await asyncio.to_thread(serve_replica_of, pid, self.node_id)
        why = self.book.register(reg, owner)
        if why:
            self._log(f"registration refused: {why}")
            return {"accepted": False, "why": why, "cgroup": "", "why_not": ""}
        cg, why_not = setup_cgroup(pid, model)
        used = used_reader(pid, device, reg.baseline_bytes)
        self.pids[pid] = Watched(PidWatch(model, pid, used, self._log), cg, why_not)
        await self._pull(reg.key)
        self._apply_limits(pid, time.monotonic())
        self._log(f"model '{model}' pid {pid}: watched (" + (f"cgroup {cg.path})" if cg else f"no cgroup: {why_not})"))
        return {"accepted": True, "why": "", "cgroup": "" if cg is None else str(cg.path), "why_not": why_not}

    async def nudge(self, pid: int) -> bool:
        """Pull the grants from the broker now; False when ``pid`` is not watched here."""
        self._ensure_loops()
        self._pull_now.set()
        return pid in self.pids

    async def report(self) -> dict[str, Any]:
        """What the agent holds: per pid its registration, limits and cgroup; the pids gone."""
        now = time.monotonic()
        held = {}
        for pid, w in self.pids.items():
            limits = self.book.limits(pid, now)
            held[str(pid)] = {
                **asdict(self.book.watched[pid]),
                "limits": None if limits is None else asdict(limits),
                "verdict": str(w.watch.verdict),
                "cgroup": "" if w.cgroup is None else str(w.cgroup.path),
                "cgroup_limit_bytes": None if w.cgroup is None else w.cgroup.limit_bytes,
                "why_not": w.why_not,
            }
        return {"node_id": self.node_id, "watched": held, "ended": list(self.ended)}

    # ---------------------------------------------------------------- the broker's grants
    async def _broker(self) -> Any:
        if self._client is None:
            import ray

            from gpubroker.broker.client import BrokerClient

            self._client = BrokerClient(ray.get_actor(self.broker_name, namespace=self.namespace), timeout_s=5.0)
        return self._client

    async def _pull(self, key: tuple[str, str]) -> None:
        model, card_id = key
        try:
            settings = await (await self._broker()).settings(model, card_id)
        except Exception as exc:  # noqa: BLE001 - the broker away: the last grant holds
            self._client = None
            self._log(f"model '{model}': grant not read from the broker ({exc!r}): the last one holds")
            return
        if self.book.grants.get(key) != settings.grant_bytes:
            self.book.set_grant(model, card_id, settings.grant_bytes)

    async def _pull_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._pull_now.wait(), timeout=POLL_S)
            except TimeoutError:
                pass
            self._pull_now.clear()
            for key in self.book.keys():
                await self._pull(key)

    # ---------------------------------------------------------------- the watch
    def _apply_limits(self, pid: int, now_s: float) -> WatchLimits | None:
        w = self.pids[pid]
        limits = self.book.limits(pid, now_s)
        if limits is not None and limits != w.limits and w.cgroup is not None:
            err = w.cgroup.set_limit(w.cgroup.limit_for(limits.grant_bytes, limits.slack_bytes))
            self._log(
                f"model '{w.watch.model}' pid {pid}: grant {limits.grant_bytes / 2**20:.1f} MiB from the broker: "
                + (f"cgroup limit not set ({err})" if err else f"cgroup limit {w.cgroup.limit_bytes / 2**20:.1f} MiB")
            )
        w.limits = limits
        return limits

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            for pid in list(self.pids):
                try:
                    self._watch_one(pid, now)
                except Exception:  # noqa: BLE001 - the agent outlives any one reading
                    logger.exception("gpubroker watchdog: pid %d: reading failed", pid)

    def _watch_one(self, pid: int, now_s: float) -> None:
        w = self.pids[pid]
        verdict = w.watch.step(self._apply_limits(pid, now_s), now_s)
        if verdict == Verdict.END and not w.ended_by_agent:
            w.ended_by_agent = end_pid(pid, self._log)
        elif verdict is None:
            self._gone(pid, now_s)

    def _gone(self, pid: int, now_s: float) -> None:
        w = self.pids.pop(pid)
        reg = self.book.watched[pid]
        self.book.forget(pid)
        entry: dict[str, Any] = {"pid": pid, "model": reg.model, "gone_s": now_s}
        entry["by"] = "watchdog" if w.ended_by_agent else "gone"
        entry["first_over_s"] = w.watch.first_over_s
        entry["grant_bytes"] = None if w.limits is None else w.limits.grant_bytes
        if w.cgroup is not None:
            kills = w.cgroup.oom_kills()
            entry.update(cgroup=str(w.cgroup.path), cgroup_limit_bytes=w.cgroup.limit_bytes, cgroup_oom_kills=kills)
            entry.update(cgroup_peak_bytes=w.cgroup.peak_bytes(), cgroup_joined_bytes=w.cgroup.joined_usage_bytes)
            if kills and not w.ended_by_agent:
                entry["by"] = "kernel"
            remove_cgroup(w.cgroup)
        self.ended.append(entry)
        self._log(f"model '{reg.model}' pid {pid} gone ({entry['by']})")


# ------------------------------------------------------------------------------------------------
# the replica's side


def agent_name(node_id: str) -> str:
    return AGENT_PREFIX + node_id[:16]


def agent_for_node(broker_name: str, namespace: str, hold_s: float) -> Any:
    """The watch agent of this process's node, started if none runs (detached, pinned to the node,
    no CPU reserved). Needs Ray: call from inside a Ray worker."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(WatchAgent)
        .options(
            name=agent_name(node_id),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=64,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(broker_name, namespace, node_id, hold_s)
    )


class AgentLink:
    """A replica's registration with its node's agent, made before the model loads; ``nudge`` on a
    grant change. ``cgroup``: its cgroup path ("" when none; ``why_not`` says why)."""

    def __init__(self, model: str, card_id: str, card_replicas: int, device: str, baseline_bytes: int, **where: Any):
        import os

        import ray

        self.pid = os.getpid()
        self.handle = agent_for_node(where["broker_name"], where["namespace"], where["hold_s"])
        ref = self.handle.register.remote(model, card_id, card_replicas, self.pid, device, int(baseline_bytes))
        answer = ray.get(ref, timeout=REGISTER_TIMEOUT_S)
        self.accepted = bool(answer["accepted"])
        self.cgroup = str(answer["cgroup"])
        self.why_not = str(answer["why"] or answer["why_not"])

    def nudge(self) -> None:
        """The grant changed here: the agent pulls the broker's now (fire and forget)."""
        self.handle.nudge.remote(self.pid)


def stop_agents(namespace: str) -> list[str]:
    """Kill every watch agent in ``namespace`` (``gpubroker down``). Ray must be initialised."""
    import ray

    done = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == namespace and str(entry.get("name", "")).startswith(AGENT_PREFIX):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
                done.append(f"watch agent {entry['name']} killed")
            except ValueError:
                pass
    return done


__all__ = [
    "AGENT_PREFIX",
    "AgentLink",
    "GrantBook",
    "Registration",
    "WatchAgent",
    "agent_for_node",
    "agent_name",
    "serve_replica_of",
    "serves",
    "stop_agents",
]
