"""The load generator against a tiny live app: every request sent has a record, statuses add up.

Starts its own Ray + Serve (``bench.scenarios.Stack``), so it runs alone: ``make chaos`` or
``pytest -m "integration and slow" tests/integration/test_bench_quick.py``. No timing is asserted.
"""

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_loadgen_records_every_request():
    from bench import loadgen as lg
    from bench import scenarios as sc
    from gpubroker.sim import arrivals as arr

    with sc.Stack() as stack:
        spec = sc.profiled_spec(2.0, 0.1, 500.0, ceiling=32)
        text = sc.fleet_yaml({"tiny": spec}, broker_name="bench-test-tiny", http_port=stack.port)
        target = stack.deploy_fleet(text, app="tiny")
        times = arr.poisson(30.0, 4.0, seed=0)
        sched = lg.merge(lg.plan("tiny", times), lg.plan("nosuch", [1.0, 2.0]))  # 2 requests to an unknown model
        res = lg.run(target.base_url, sched, timeout_s=10.0, status_url=target.status_url, status_every_s=0.5)
        target.delete()

    assert len(res.records) == len(sched)
    assert all(r.status != -1 and r.send_s is not None and r.finish_s is not None for r in res.records)
    assert all(r.latency_ms is not None and r.latency_ms >= 0 for r in res.records)
    summ = lg.summarize(res.records, 4.0, {"tiny": 500.0, "nosuch": 500.0})
    tiny, bad = summ["tiny"], summ["nosuch"]
    assert tiny.offered == len(times)
    assert tiny.completed + tiny.rejections + tiny.timeouts + tiny.errors == tiny.offered
    assert tiny.completed > 0
    assert bad.offered == 2 and bad.completed == 0 and bad.errors == 2  # 404s are misses, counted
    assert any(r.batch is not None for r in res.records if r.model == "tiny")  # batch tags came back
    assert res.status_samples and "tiny" in res.status_samples[-1]["status"]["models"]
