"""CPU time of gpubroker's own replica path per request, validation in a thread against inline.

One ``ModelReplica`` in this process (no Ray, no Serve proxy: Serve's real batcher, the
``profiled`` emulation sleeping ``a + c*b``, an in-process ``BrokerCore`` behind a stand-in for
the actor handle), eight closed-loop clients, ``--requests`` requests per arm; the arms run
interleaved (``--rounds`` each): ``thread`` keeps validation in a worker thread, ``inline`` lets
``gpubroker.deployments.replica.inline_work`` move it onto the loop once measured cheap. Process CPU time per
request (``time.process_time``: every thread) is what each arm costs; the serving path around
it (proxy, actor calls) is ``bench.cost_per_request``'s. Run::

    .venv/bin/python -m bench.replica_cpu --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import ModelSettings, StatsReport
from gpubroker.deployments.replica.deployment import ModelReplica
from gpubroker.quotas.config import parse_config_text

MIB = 1024**2
CONFIG = """
broker: {name: rcpu, namespace: rcpu, control_interval_s: 5, report_interval_s: 5, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0}
models:
  prof:
    model: profiled
    options: {a_ms: 2, c_ms: 0.1, weights_bytes: 1048576, bytes_per_item: 0}
    quota: {min: 16MiB, base: 128MiB, max: 128MiB}
    slo_p95_ms: 5000
"""


class _Call:
    """``handle.<name>.remote``: plain data both ways, as ``gpubroker.broker.actor`` converts it over Ray."""

    def __init__(self, core: BrokerCore, name: str) -> None:
        self.fn, self.name = getattr(core, name), name

    async def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.name == "report":
            args = (StatsReport.from_dict(args[0]), *args[1:])
        out = self.fn(*args, **kwargs)
        return out.to_dict() if isinstance(out, ModelSettings) else out


class _Handle:
    """The broker actor's handle, in front of an in-process core."""

    def __init__(self, core: BrokerCore) -> None:
        self.core = core

    def __getattr__(self, name: str) -> _Call:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Call(self.core, name)


async def _replica(ckpt: Path) -> ModelReplica:
    """A replica whose broker handle is the in-process core (set on the instance: the class is
    left as it is)."""
    handle = _Handle(BrokerCore(CONFIG, capacity_bytes=1024 * MIB, checkpoint=ckpt))
    r = ModelReplica.__new__(ModelReplica)
    r._broker_handle = lambda: handle  # type: ignore[method-assign]
    await r.__init__("prof", parse_config_text(CONFIG))
    r._report_task.cancel()
    return r


class _OutsideServe:
    """Serve's batcher asks the replica context for a check that needs Serve: off while the arms run."""

    def __enter__(self) -> None:
        from ray.serve import batching

        self.queue = batching._BatchQueue
        self.warn = self.queue._warn_if_max_batch_size_exceeds_max_ongoing_requests
        self.queue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda _self: None

    def __exit__(self, *exc: object) -> None:
        self.queue._warn_if_max_batch_size_exceeds_max_ongoing_requests = self.warn


async def arm(mode: str, requests: int, tmp: Path) -> dict[str, Any]:
    r = await _replica(tmp / f"{mode}-{time.monotonic_ns()}.json")
    if mode == "thread":
        r.validating.warm = 1 << 62  # never measured cheap enough: always the thread
    for _ in range(50):  # warm-up (and, inline, the measurements that move validation)
        await r.infer([{}])

    async def client(n: int) -> None:
        for _ in range(n):
            out = await r.infer([{}])
            assert out["status"] == 200, out

    c0 = time.process_time()
    await asyncio.gather(*[client(requests // 8) for _ in range(8)])
    ms = (time.process_time() - c0) * 1000.0 / (requests // 8 * 8)
    return {"mode": mode, "cpu_ms_per_request": round(ms, 3), "inline": r.validating.inline()}


async def main_async(rounds: int, requests: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, _OutsideServe():
        for _ in range(rounds):
            for mode in ("thread", "inline"):
                runs.append(await arm(mode, requests, Path(tmp)))
                print(runs[-1], flush=True)  # noqa: T201 - progress
    med = {m: statistics.median(x["cpu_ms_per_request"] for x in runs if x["mode"] == m) for m in ("thread", "inline")}
    return {
        "runs": runs,
        "median_cpu_ms_per_request": med,
        "inline_over_thread": round(med["inline"] / med["thread"], 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1600)
    args = ap.parse_args(argv)
    res = asyncio.run(main_async(args.rounds, args.requests))
    print(f"median CPU ms/request: {res['median_cpu_ms_per_request']}; inline/thread {res['inline_over_thread']}")  # noqa: T201
    return res


if __name__ == "__main__":
    main()
