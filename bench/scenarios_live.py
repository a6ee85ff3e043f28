"""The live-stack scenarios of ``python -m bench``: seed, oracle, burst, overhead, trace.

Every scenario starts its own Ray + Serve (``bench.scenarios.Stack``), deploys one app per
arm, runs open-loop HTTP load (``bench.loadgen``) and tears everything down. Arms compared
in one scenario see the same arrivals (same seed) and run side by side in one process, so
their *ratios* are the result; absolute numbers on a shared 2-core machine are noisy.

Time scale. On a 2-core host the Serve HTTP path (proxy, ingress, replica, client) tops out
well under the a=20 ms / c=0.5 ms profile's knee (~455/s, BENCHMARK.md's model). The ``profiled``
emulation is therefore run slowed down by ``time_scale`` k (default 10: a=200 ms, c=5 ms,
and the static arm's 10 ms wait becomes 100 ms): rates fall by k and every ratio the
benchmark reports (knee gain, oracle ratio, knee/bound) is unchanged by the scale. It is an
EMULATION (``profiled`` sleeps a + c·b) and the tables say so; MiniLM is real compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.live_load import burst, overhead, trace
from bench.live_oracle import oracle, oracle_knee
from bench.live_runs import Opts
from bench.live_seed import seed

SCENARIOS: dict[str, Callable[[Opts], dict[str, Any]]] = {
    "seed": seed,
    "oracle": oracle,
    "burst": burst,
    "overhead": overhead,
    "trace": trace,
    "oracle-knee": oracle_knee,
}
