"""gpubroker: share GPUs between Ray Serve models."""
