"""Serve and HTTP glue: a model's own ingress (``http_model``) and its HTTP rules (``http_api``), the
fleet API (``ingress``), the plan follower (``follow``), replica targets (``scaler``), re-placement
(``reconcile``, ``placement_resources``, ``http_cards``), Serve versions, the proxy's refusals and
why a deployment failed (``failures``).

Imported by ``gpubroker.deployments.app`` and ``cluster`` (which deploys and waits on Serve); it
imports ``replica`` and ``enforce``, never ``cluster``.
"""
