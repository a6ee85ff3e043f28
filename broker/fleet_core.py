"""The broker for a fleet of many cards: one ``BrokerCore`` per card, one tick for all.

A card is a memory domain: quota moves only inside it, so every card gets the core it would
have alone, built from the fleet config restricted to the models placed on it
(``gpubroker.quotas.card_fleet.card_config``). ``FleetBroker`` routes each replica's calls to its card's
core, ticks every live core (each card's decision holds its models' replica targets:
``gpubroker.broker.control.replica_targets``), shares one decision log and merges ``status``. A card whose replicas all fall silent for
``DEAD_AFTER_S``, or whose node left the Ray cluster (``observe_cards``), is lost; with
re-placement on (a follower applies it: ``gpubroker.deployments.serve.follow``) its replicas are placed again on
the live cards (``gpubroker.broker.control.replacement``). ``plan()`` is what the Serve side must apply
(``gpubroker.broker.wire.ServePlan``). The Ray actor and the simulator both drive this object.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from prometheus_client import CollectorRegistry

from gpubroker.broker.control.decision_log import DecisionLog
from gpubroker.broker.control.replacement import (
    FleetEntry,
    Replacement,
    read_placement,
    replace_fleet,
    write_placement,
)
from gpubroker.broker.control.replica_targets import replicas_entry
from gpubroker.broker.control.window import stale_after_s
from gpubroker.broker.core import BrokerCore
from gpubroker.broker.fleet_store import FleetStore
from gpubroker.broker.metrics import BrokerMetrics, NullMetrics
from gpubroker.broker.wire import (
    ApplyResult,
    BrokerStatus,
    Calibration,
    CardCheckpoint,
    CardHealth,
    DecisionRecord,
    ModelSettings,
    RejectionsCounted,
    ReplicaTarget,
    ServePlan,
    StatsReport,
    TickResult,
)
from gpubroker.quotas.card_fleet import card_config
from gpubroker.quotas.cards import Card
from gpubroker.quotas.config import FleetConfig, parse_config_text
from gpubroker.quotas.placement import Placement, place_fleet

DEAD_AFTER_S = 15.0  # a card with registered replicas none of which reported for this long is lost


class FleetBroker:
    """Many cards, one broker. Same calls as ``BrokerCore`` plus a ``card_id`` on replica calls."""

    def __init__(
        self,
        config: str | FleetConfig,
        *,
        cards: tuple[Card, ...] | None = None,
        capacity_bytes: int | None = None,
        checkpoint_path: str | Path | None = None,
        clock: Callable[[], float] = time.time,
        metrics: BrokerMetrics | NullMetrics | None = None,
    ) -> None:
        self._clock = clock
        self._source = config  # the simulator's parsed config goes to a one-card core as it is
        if isinstance(config, FleetConfig):
            self._cfg, self._text = config, json.dumps(config.model_dump(mode="json"))
        else:
            self._cfg, self._text = parse_config_text(config, "broker config"), config
        self._discovered = cards
        self._capacity = capacity_bytes
        self._checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        cfg0 = self._cfg
        self.metrics = (
            metrics
            if metrics is not None
            else BrokerMetrics(CollectorRegistry(), gpu=cfg0.gpu.device if cfg0.gpus is None else "fleet")
        )
        self.log = DecisionLog(self._cfg.broker.decision_log_size)
        path, log = self._checkpoint_path, self.log
        self._store = FleetStore(path, single=self.single, launch_hash=cfg0.config_hash(), log=log)
        log_problem = self._store.restore_log()  # before any entry is appended (gpubroker.broker.fleet_store)
        self._placement = place_fleet(self._cfg, cards, capacity_bytes)
        self.cores: dict[str, BrokerCore] = {}
        self._seen: dict[str, float] = {}  # card -> last report time of any of its replicas
        self.lost: set[str] = set()
        self._deployed = self._placement  # as deployed: apply compares a new config's placement with it
        self.placement_version = 0  # +1 per re-placement; the actor reconciles Serve after a change
        self.unplaced_reasons: dict[str, str] = {}  # model -> why its unplaced replicas fit nowhere
        self._replacing = False  # enable_replacement: a loss or join re-places (module note)
        self._observed: set[str] = set()  # cards seen on a live node (observe_cards)
        self._registered: dict[
            tuple[str, str], dict[str, Calibration | None]
        ] = {}  # (card, model) -> replica id -> calibration
        self._launch_hash = self._cfg.config_hash()
        if log_problem:
            self._event(log_problem)
        self._restore_placement()
        for plan in self._placement.cards:
            if plan.models:
                self.cores[plan.card.id] = self._make_core(plan.card.id)
        self._store.save(self.cores)

    # ------------------------------------------------------------------ construction
    @property
    def single(self) -> bool:
        return self._cfg.gpus is None

    def _make_core(self, card_id: str) -> BrokerCore:
        path, slot = self._store.core_path(), self._store.slot(card_id)
        config = self._source if self.single else card_config(self._cfg, self._placement, card_id)
        metrics = self.metrics
        if not self.single and isinstance(metrics, BrokerMetrics):
            metrics = metrics.for_gpu(card_id)  # metrics carry gpu=<card id>
        return BrokerCore(
            config,
            capacity_bytes=int(self._placement.card(card_id).capacity_bytes),
            checkpoint=slot or path,
            clock=self._clock,
            metrics=metrics,
            log=self.log,
            card_id="" if self.single else card_id,
        )

    def _core(self, model: str, card_id: str) -> BrokerCore:
        if not card_id:
            cards = self._placement.cards_of(model) if model in self._placement.replicas else ()
            if len(cards) != 1:
                raise KeyError(
                    f"model '{model}' runs on cards {', '.join(cards) or 'none'}; the replica must say its card_id"
                )
            card_id = cards[0]
        core = self.cores.get(card_id)
        if core is None:
            raise KeyError(f"unknown card '{card_id}'; the broker manages {', '.join(self.cores)}")
        return core

    # ------------------------------------------------------------------ replica RPCs
    def register(
        self, model: str, replica_id: str, calibration: Calibration | None, card_id: str = ""
    ) -> ModelSettings:
        core = self._core(model, card_id)
        self._mark_alive(core)
        known = self._registered.setdefault((core.card_id, model), {})
        known[replica_id] = calibration  # replayed on a rebuilt core (re-placement)
        while len(known) > 16:
            known.pop(next(iter(known)))
        return core.register(model, replica_id, calibration)

    def report(self, report: StatsReport) -> ModelSettings:
        """One replica's delta to its card's core (by the card it says it runs on); its settings back."""
        core = self._core(report.model, report.card_id)
        self._mark_alive(core)
        return core.report(report)

    def _mark_alive(self, core: BrokerCore) -> None:
        cid = core.card_id or next(iter(self.cores))
        self._seen[cid] = self._clock()
        if cid in self.lost:
            self.lost.discard(cid)
            self._event(f"card {cid}: replicas report again; live", card=cid)

    def card_health(self) -> CardHealth:
        """Lost cards, and live ones none of whose replicas reported for ``stale_after_s`` (a node
        may be gone but not yet lost): card routers avoid both (``gpubroker.deployments.serve.http_cards``)."""
        now, after_s = self._clock(), stale_after_s(self._cfg)
        silent = [c for c, seen in self._seen.items() if c not in self.lost and now - seen > after_s]
        return {"lost": sorted(self.lost), "silent": sorted(silent)}

    def report_rejections(self, counts: Mapping[str, int]) -> RejectionsCounted:
        """Rejections the ingress made (it knows no card): counted on each model's first card."""
        taken: dict[str, int] = {}
        for model, n in counts.items():
            cards = self._placement.cards_of(model) if model in self._placement.replicas else ()
            if cards:  # the ingress does not know the card: count them on the model's first
                taken.update(self.cores[cards[0]].report_rejections({model: n})["counted"])
        return {"counted": taken}

    # ------------------------------------------------------------------ control
    def tick(self) -> TickResult:
        now = self._clock()
        cards: dict[str, TickResult] = {}
        changed: list[str] = []
        out: TickResult = {"ok": True, "now_s": now, "changed": changed, "cards": cards}
        # a one-card fleet has no other card to fall back to: its core always ticks (the core's
        # own staleness rules cover silent replicas); only a card of many can be lost
        silent = {
            cid: now - seen
            for cid in self.cores
            if not self.single and (seen := self._seen.get(cid)) is not None and now - seen > DEAD_AFTER_S
        }
        gone = [cid for cid in silent if cid not in self.lost]
        for cid in gone:
            self._lose(cid, f"no report from its replicas for {silent[cid]:.0f}s")
        nodes = {self._placement.card(cid).node for cid in gone}
        for plan in self._placement.cards:  # an empty card of that node is taken as gone with it
            if plan.card.node in nodes and not plan.models and plan.card.id not in self.lost:
                self._lose(plan.card.id, f"its node {plan.card.node} fell silent")
        if gone and self._replacing:
            self._replace(f"card {', '.join(gone)} lost")
        for cid, core in self.cores.items():
            if cid in self.lost:
                continue
            res = core.tick()
            cards[cid] = res
            changed.extend(res.get("changed", []))
            out["profile"] = res.get("profile")
            out["dry_run"] = res.get("dry_run")
        # each card's decide set its replica targets; their changes are logged after every card's
        # settings, as one block for the fleet
        dry, replicas_changed = self._cfg.broker.dry_run, []
        for cid, core in self.cores.items():
            if cid not in self.lost:
                for change in core.replica_changes:
                    self.log.append(*replicas_entry(change, "" if self.single else cid, dry))
                    replicas_changed.append(change.model)
        out["replicas_changed"] = replicas_changed
        self.metrics.observe_checkpoint(self._store.save(self.cores))  # every card's in one write
        return out

    # ------------------------------------------------------------------ loss, join, re-placement
    @property
    def _placement_path(self) -> Path | None:
        single = self.single or self._checkpoint_path is None
        return None if single else self._checkpoint_path.with_suffix(".placement.json")  # type: ignore[union-attr]

    def _restore_placement(self) -> None:
        """A restarted broker runs the placement it had re-placed to (what Serve runs), not the config's."""
        path = self._placement_path
        try:
            got = read_placement(path, self._launch_hash, self._deployed, self._cfg) if path else None
        except ValueError as exc:
            got = None
            self._event(f"{exc}; the config's placement runs")
        if got is not None:
            self._placement, self.lost, self.placement_version = got
            self._event(
                f"placement {self.placement_version} restored from {path} (lost: {sorted(self.lost) or 'none'})"
            )

    @property
    def replacing(self) -> bool:
        """Re-placement is on (``enable_replacement``)."""
        return self._replacing

    def enable_replacement(self) -> None:
        """From now on a loss or a join re-places the fleet (someone applies it to Serve)."""
        self._replacing = not self.single

    def _lose(self, cid: str, why: str) -> None:
        self.lost.add(cid)
        then = "its replicas are re-placed" if self._replacing else "its grants stay frozen until they return"
        self._event(f"card {cid}: {why}; lost ({then})")

    def _event(self, reason: str, model: str | None = None, kind: str = FleetEntry.CARD, **extra: Any) -> None:
        entry = {"kind": kind, "time_s": self._clock(), "model": model, "reason": reason, **extra}
        self.log.append(cast(DecisionRecord, entry), f"[{kind}] {reason}")

    def observe_cards(self, alive: Iterable[str]) -> bool:
        """The cards whose node is in the Ray cluster now (the reconciler reads Ray's resources).
        With re-placement on: a card seen before and gone is lost now; a lost card seen again is
        live and empty, and unplaced replicas are placed (on it or elsewhere). True when the
        placement changed."""
        if not self._replacing:
            return False
        now_alive = set(alive) & {p.card.id for p in self._placement.cards}
        gone = sorted(c for c in self._observed - now_alive if c not in self.lost)
        back = sorted(c for c in now_alive & self.lost)
        self._observed = (self._observed | now_alive) - set(gone)
        version = self.placement_version
        for cid in gone:
            self._lose(cid, "its node left the Ray cluster")
        for cid in back:
            self.lost.discard(cid)
            self._seen.pop(cid, None)
            self._event(f"card {cid}: its node is in the cluster again; live, free for new replicas")
        if gone or (back and self._placement.unplaced):
            self._replace(f"card {', '.join(gone)} lost" if gone else f"card {', '.join(back)} joined")
        return self.placement_version != version

    def _replace(self, why: str) -> Replacement:
        """Re-place over the live cards; rebuild the cores of the cards that changed (module note)."""
        rep = replace_fleet(self._placement, self._cfg, self.lost)
        old = self._placement
        self._placement = rep.placement
        self.unplaced_reasons = dict(rep.reasons)
        if not rep.changed and dict(rep.unplaced) == dict(old.unplaced):
            return rep
        for cid in rep.cards_changed:
            self.cores.pop(cid, None)
            if not rep.placement.card_plan(cid).models:
                continue
            core = self.cores[cid] = self._make_core(cid)
            for (card, model), known in self._registered.items():
                if card == cid and model in core.config.models:
                    for rid, cal in known.items():  # the replicas already there keep their calibration
                        core.register(model, rid, cal)
        self.placement_version += 1
        if self._placement_path is not None:
            write_placement(self._placement_path, rep.placement, self.lost, self.placement_version, self._launch_hash)
        for m in rep.models_changed:
            now = rep.placement.groups_of(m)
            self._event(
                f"{m}: {why}; re-placed from {old.groups_of(m) or 'nowhere'} to {now or 'nowhere'}"
                + (f"; {rep.unplaced[m]} replica(s) unplaced: {rep.reasons[m]}" if rep.unplaced.get(m) else ""),
                m,
                FleetEntry.PLACEMENT,
                cards=now,
                unplaced=rep.unplaced.get(m, 0),
            )
        for m in (m for m in rep.unplaced if m not in rep.models_changed):
            self._event(f"{m}: {rep.unplaced[m]} replica(s) still unplaced: {rep.reasons[m]}", m, FleetEntry.PLACEMENT)
        self._store.save(self.cores)
        return rep

    def apply(self, config_text: str) -> ApplyResult:
        """A new config for every card, or none: placement must stay as deployed. Every outcome
        shows in the reload metrics (the cores count their own; refusals here are counted here)."""
        out = self._apply(config_text)
        if not out.get("_counted"):
            self.metrics.observe_reload(bool(out["ok"]), str(out["config_hash"]))
        self._store.save(self.cores)
        return ApplyResult(
            ok=bool(out["ok"]),
            config_hash=str(out["config_hash"]),
            issues=[str(i) for i in out.get("issues", [])],
            notes=[str(n) for n in out.get("notes", [])],
        )

    def _apply(self, config_text: str) -> dict[str, Any]:
        from gpubroker.quotas.config import ConfigError

        if self.single:  # one card: the core's own checks and messages (a model added, a field that needs up)
            core = next(iter(self.cores.values()))
            out: dict[str, Any] = dict(core.apply(config_text))
            if out["ok"]:
                self._cfg, self._text, self._source = core.config, config_text, config_text
            out["_counted"] = True
            return out

        try:
            cfg = parse_config_text(config_text, "apply")
        except ConfigError as exc:
            return {"ok": False, "config_hash": self.config_hash, "issues": [str(i) for i in exc.issues]}
        try:
            placement = place_fleet(cfg, self._discovered, self._capacity)
        except ValueError as exc:
            return {"ok": False, "config_hash": self.config_hash, "issues": [str(exc)]}
        if placement.replicas != self._deployed.replicas or set(placement.replicas) != set(self._deployed.replicas):
            return {
                "ok": False,
                "config_hash": self.config_hash,
                "issues": [
                    "the new config places replicas on other cards; placement is decided at deploy time, "
                    "so this needs `gpubroker down` then `gpubroker up NEW_CONFIG`"
                ],
            }
        if self.single:
            out = dict(next(iter(self.cores.values())).apply(config_text))
            out["_counted"] = True
        else:
            old_cfg, old_text = self._cfg, self._text
            applied: list[str] = []
            out = {"ok": True, "issues": [], "notes": []}
            for cid, core in self.cores.items():
                # the cards as they run now (re-placed or as deployed)
                res = core._apply(card_config(cfg, self._placement, cid).model_dump_json())  # noqa: SLF001 - counted once
                if not res["ok"]:  # put back the cards already changed: all or nothing
                    for done in applied:
                        self.cores[done]._apply(card_config(old_cfg, self._placement, done).model_dump_json())  # noqa: SLF001
                    self._cfg, self._text = old_cfg, old_text
                    return {
                        "ok": False,
                        "config_hash": self.config_hash,
                        "issues": [f"card {cid}: {i}" for i in res["issues"]],
                    }
                applied.append(cid)
                out["notes"].extend(f"card {cid}: {n}" for n in res.get("notes", []))
        if out["ok"]:
            self._cfg, self._text, self._source, self._deployed = cfg, config_text, config_text, placement
            if self.placement_version == 0:
                self._placement = placement
        out["config_hash"] = self.config_hash
        return out

    def checkpoint_now(self) -> dict[str, CardCheckpoint]:
        """Every card's state saved now: card id -> where it went."""
        out = {cid: core.checkpoint_now() for cid, core in self.cores.items()}
        self._store.save(self.cores)
        return out

    # ------------------------------------------------------------------ reading
    def _target(self, card_id: str, model: str) -> int:
        """The replica target of ``model`` on a card (gpubroker.broker.control.replica_rules; configured before a tick)."""
        return self.cores[card_id].replica_target(model)

    @property
    def config(self) -> FleetConfig:
        return self._cfg

    @property
    def config_text(self) -> str:
        return self._text

    @property
    def config_hash(self) -> str:
        return self._cfg.config_hash()

    @property
    def placement(self) -> Placement:
        return self._placement

    def decisions(self, model: str | None = None, since_seq: int = 0) -> list[DecisionRecord]:
        return self.log.since(model, since_seq)

    def plan(self) -> ServePlan:
        """What the Serve side must apply now (``gpubroker.broker.wire.ServePlan``): the placement's card
        groups, the unplaced, every live card's replica targets."""
        live = {cid: core for cid, core in self.cores.items() if cid not in self.lost}
        return ServePlan(
            version=self.placement_version,
            groups={m: self._placement.groups_of(m) for m in self._cfg.models},
            unplaced={m: self.unplaced_reasons.get(m, "") for m in self._placement.unplaced},
            replica_targets=tuple(
                ReplicaTarget(m, cid, self._target(cid, m)) for cid, core in live.items() for m in core.config.models
            ),
            replacing=self._replacing,
            dry_run=self._cfg.broker.dry_run,
        )

    def settings(self, model: str, card_id: str = "") -> ModelSettings:
        return self._core(model, card_id).settings(model)

    def status(self) -> BrokerStatus:
        """The cards' statuses merged (module note); built as plain data, the keys of ``BrokerStatus``."""
        per: dict[str, dict[str, Any]] = {cid: dict(core.status()) for cid, core in self.cores.items()}
        first = next(iter(per.values()))
        out = dict(first) if self.single else {k: v for k, v in first.items() if k not in ("models",)}
        cards = []
        models: dict[str, dict[str, Any]] = {}
        for plan in self._placement.cards:
            cid = plan.card.id
            st = per.get(cid)
            entry: dict[str, Any] = {
                "id": cid,
                "node": plan.card.node,
                "device": str(plan.card.device),
                "capacity_bytes": int(plan.card.capacity_bytes),
                "usable_bytes": st["usable_bytes"] if st else plan.usable_bytes,
                "granted_bytes": st["granted_bytes"] if st else 0,
                "used_bytes": st["used_bytes"] if st else 0,
                "live": cid not in self.lost,
                "price_per_gpu_hour": st["price_per_gpu_hour"] if st else None,  # the card's whole cost per hour
                "models": {},
            }
            for name, m in (st["models"] if st else {}).items():
                entry["models"][name] = {
                    "grant_bytes": m["grant_bytes"],
                    "used_bytes": m["used_bytes"],
                    "replicas": m["replicas"],
                    "replica_target": self._target(cid, name),
                    "cost_per_1k_requests": m.get("cost_per_1k_requests"),  # this card's share, its requests here
                    "memory_ceiling": m.get("memory_ceiling"),  # the batch this card's grant holds (memory_view)
                }
                models.setdefault(name, _merge_start(m)) if name not in models else _merge(models[name], m)
                models[name].setdefault("cards", []).append(cid)
            cards.append(entry)
        out["cards"] = cards
        out["placement_version"] = self.placement_version
        out["unplaced"] = {
            m: {"replicas": n, "reason": self.unplaced_reasons.get(m, "")} for m, n in self._placement.unplaced.items()
        }
        for name, m in models.items():
            m.pop("_spent", None)
            m["replica_target"] = sum(c["models"][name]["replica_target"] for c in cards if name in c["models"])
        if not self.single:
            live = [c for c in cards if c["live"]]
            out["models"] = models
            out["config_hash"] = self.config_hash
            out["capacity_bytes"] = sum(c["capacity_bytes"] for c in cards)
            out["usable_bytes"] = sum(c["usable_bytes"] for c in cards)
            out["granted_bytes"] = sum(c["granted_bytes"] for c in live)
            out["used_bytes"] = sum(c["used_bytes"] for c in live)
            out["device"] = "cards"
        else:
            for name in out["models"]:
                out["models"][name]["cards"] = [cards[0]["id"]]
                out["models"][name]["replica_target"] = cards[0]["models"][name]["replica_target"]
        return cast(BrokerStatus, out)


_SUMMED = (
    "grant_bytes",
    "base_bytes",
    "used_bytes",
    "queue_depth",
    "arrival_rate_rps",
    "completion_rate_rps",
    "replicas",
    "completions",
    "misses",
    "emergency_shrinks",
    "oom_splits",
)


def _spent(m: dict[str, Any]) -> float:
    """What a model's requests on one card cost in all (cost per 1k x completions / 1000)."""
    cost = m.get("cost_per_1k_requests")
    return 0.0 if cost is None else cost * (m.get("completions") or 0) / 1000.0


def _merge_start(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "_spent": _spent(m)}


def _merge(acc: dict[str, Any], m: dict[str, Any]) -> None:
    """Fold a model's status on another card into its fleet entry: counts summed, worst P95."""
    for key in _SUMMED:
        if key in m and m[key] is not None:
            acc[key] = (acc.get(key) or 0) + m[key]
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        if m.get(key) is not None and (acc.get(key) is None or m[key] > acc[key]):
            acc[key] = m[key]
    acc["_spent"] = acc.get("_spent", 0.0) + _spent(m)  # card-hours on every card it holds, summed
    done = acc.get("completions") or 0
    acc["cost_per_1k_requests"] = acc["_spent"] / done * 1000.0 if done else None
