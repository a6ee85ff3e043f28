"""A model that goes around its in-process limit, driven and measured from outside (issue 37).

``drive_violator`` sends ``{"mb": N}`` to the violator at a fixed pace while a sampler in this
process reads the violator replica's resident memory from /proc every 50 ms until the process
ends; a neighbour gets open-loop load meanwhile. ``Violation`` holds what was measured: the peak
over the pre-model baseline, how long the process stayed over grant + slack before it ended
(the bound of ``gpubroker.deployments.enforce.watch.END_BOUND_S``), and every status each model got.
Every request sent, the violator's own included, is counted in ``Violation.requests``
(``tests/chaos/tally.py``): a chaos row's count.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gpubroker.broker.control.violation import WATCH_SLACK_BYTES
from tests.chaos.tally import Tally
from tests.integration._fleet import replica_status
from tests.integration._load import open_loop_bg

MiB = 1024**2


def _rss(pid: int) -> int | None:
    from gpubroker.deployments.enforce.probes import proc_status_bytes

    return proc_status_bytes(pid).get("VmRSS")


@dataclass
class Violation:
    pid: int
    grant_bytes: int
    baseline_bytes: int
    samples: list[tuple[float, int | None]] = field(default_factory=list)  # (monotonic s, bytes over baseline)
    codes: Counter = field(default_factory=Counter)  # the violator's statuses
    details: list[str] = field(default_factory=list)  # its 503 details
    neighbour: Counter = field(default_factory=Counter)
    own: Tally = field(default_factory=Tally)  # the violator's requests, counted with their bodies
    neighbour_requests: Tally = field(default_factory=Tally)
    during: Any = None  # what ``during()`` returned as the violator's load ended (e.g. the broker's status)

    @property
    def requests(self) -> Tally:
        """Every request this run sent: the violator's own and its neighbour's."""
        return self.own + self.neighbour_requests

    @property
    def bound_bytes(self) -> int:
        return self.grant_bytes + WATCH_SLACK_BYTES

    @property
    def ended(self) -> bool:
        return bool(self.samples) and self.samples[-1][1] is None

    @property
    def peak_over_bytes(self) -> int:
        return max((b for _, b in self.samples if b is not None), default=0)

    @property
    def over_s(self) -> float:
        """From the first sample over grant + slack to the first after it at or under the grant
        (or the process gone); 0 when it never went over."""
        start = next((t for t, b in self.samples if b is not None and b > self.bound_bytes), None)
        if start is None:
            return 0.0
        end = next((t for t, b in self.samples if t > start and (b is None or b <= self.grant_bytes)), None)
        return (self.samples[-1][0] if end is None else end) - start


def _sample(v: Violation, stop: threading.Event) -> None:
    while not stop.is_set():
        rss = _rss(v.pid)
        v.samples.append((time.monotonic(), None if rss is None else max(0, rss - v.baseline_bytes)))
        if rss is None:
            return
        time.sleep(0.05)


def drive_violator(
    url: str,
    app: str,
    model: str,
    mb: int,
    rate: float,
    duration_s: float,
    neighbour: str,
    neighbour_body: dict,
    during: Callable[[], Any] | None = None,
) -> Violation:
    """Drive ``model`` at ``rate`` requests/s of ``mb`` MiB for ``duration_s`` (and ``neighbour``
    open-loop at 8/s over the same time plus 30 s: the violator's restart), sampling its process."""
    st = replica_status(app, model)
    grant = st["settings"]["grant_bytes"]  # one replica: its grant is the model's
    v = Violation(st["pid"], grant, st.get("watch_baseline_bytes") or st["memory_limit"]["baseline_rss_bytes"])
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(v, stop), daemon=True)
    sampler.start()
    mlp_thread, v.neighbour = open_loop_bg(
        url, neighbour, 8.0, duration_s + 30.0, neighbour_body, seed=5, timeout_s=60, tally=v.neighbour_requests
    )
    with httpx.Client(timeout=30) as client:
        t0 = time.monotonic()
        for i in range(int(duration_s * rate)):
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            try:
                r = v.own.call(lambda: client.post(f"{url}/v1/models/{model}/infer", json={"input": {"mb": mb}}))
            except httpx.HTTPError:
                v.codes[0] += 1
                continue
            v.codes[r.status_code] += 1
            if r.status_code == 503:
                v.details.append(r.json().get("detail", ""))
    v.during = None if during is None else during()
    sampler.join(timeout=60)  # the process ends within the bound, or the test says it did not
    stop.set()
    mlp_thread.join(timeout=duration_s + 120)
    return v


def serves_again(
    url: str, app: str, model: str, old_pid: int, *, tally: Tally, timeout_s: float = 180.0, new_process: bool = True
) -> tuple[int, int]:
    """Once the violator's load stopped: a request that keeps nothing is answered (by a new
    replica process unless ``new_process`` is False), each one counted in ``tally``. Returns
    (the pid that answered, status)."""
    deadline = time.monotonic() + timeout_s
    status = 0
    while time.monotonic() < deadline:
        try:
            pid = replica_status(app, model)["pid"]
            if pid != old_pid or not new_process:
                r = tally.call(
                    lambda: httpx.post(f"{url}/v1/models/{model}/infer", json={"input": {"mb": 0}}, timeout=30)
                )
                status = r.status_code
                if status == 200:
                    return pid, status
        except Exception:  # noqa: BLE001 - the replica is being replaced
            pass
        time.sleep(1.0)
    return old_pid, status
