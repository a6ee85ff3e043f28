"""The Ray cluster and the fleet's lifecycle, without a UI: ``fleet`` (deploy, wait, ``up``, ``down``),
``fleet_client`` (the state file, connecting, the broker's API), ``local_ray`` (a head of our own),
``ray_auth`` (token auth on), ``discovery`` (``gpus: auto``), ``first_requests`` and ``user_code``
(the user's project, what to ship).

Imported by the command line (``gpubroker.cli``) and the tests; it imports ``app``, ``serve`` and
``models``.
"""
