"""The grant as a limit, not a number: the in-process limits (``limits``: RLIMIT_DATA on CPU, torch's
memory fraction on CUDA), the measurement layer (``watch``: a watcher thread and a watchdog process
outside the model) and the kernel's memory cgroup (``cgroup``). docs/ENFORCEMENT.md says what each
layer stops.

Imported by ``replica`` and ``llm``; it imports only ``gpubroker.broker`` (the violation rule and the
probes) and the standard library.
"""
