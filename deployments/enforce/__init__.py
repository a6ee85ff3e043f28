"""The grant as a limit, not a number: the in-process limits (``limits``: RLIMIT_DATA on CPU, torch's
memory fraction on CUDA), the measurement layer (``watch``: a watcher thread and a watchdog process
outside the model), the kernel's memory cgroup (``cgroup``) and the memory readings they and the
replica take (``probes``: NVML, torch, /proc). docs/ENFORCEMENT.md says what each layer stops.

Imported by ``replica`` and ``serve`` (a managed deployment's limit and readings); it imports
only ``gpubroker.broker`` (the violation rule, and ``capacity``: the device and the card's size) and
the standard library.
"""
