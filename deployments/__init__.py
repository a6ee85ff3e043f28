"""The Serve side of gpubroker, in rooms by concept. Each room's docstring says what it holds and
who may import it; every room may import ``gpubroker.broker`` (the wire types) and ``gpubroker.quotas``.

- ``app``: the Serve application builders, the one door a Serve config file names
  (``import_path: gpubroker.deployments.app:build_app``);
- ``serve/``: Serve and HTTP glue: the model and fleet ingresses, the plan follower, replica
  scaling, re-placement, versions, why a deployment failed;
- ``replica/``: one model replica: the Serve deployment class and its pure units (gate, fast loop,
  the split of a failing batch, shedding), its link to the broker, its calibration;
- ``enforce/``: the grant as a limit: in-process limits, the watchers, the kernel cgroup, and the
  memory probes they and the replica read;
- ``cluster/``: the Ray cluster and the fleet's lifecycle (``up``/``down``, the state file, a local
  head, token auth, card discovery, the first requests, the user's project);
- ``models/``: model adapters and user-model resolution;
- ``llm/``: LLM engines (vLLM) and their OpenAI-compatible server.
"""
