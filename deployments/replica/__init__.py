"""One model replica: the Serve deployment class (``deployment.ModelReplica``) and its pure units
(admission gate, fast loop, the split of a failing batch, shedding, batch formation, reclaim),
its link to the broker and its start-up calibration.

Imported by ``gpubroker.deployments.serve`` (the HTTP ingress around the replica), ``llm`` (the
broker link) and the simulator (``gpubroker.sim``, which runs the same pure units); it imports
``enforce`` and ``models``, never ``serve`` or ``cluster``.
"""
