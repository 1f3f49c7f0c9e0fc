"""Topology-aware placement of model instances.

- `topology`: the host's GPUs, their pairwise links and the CPU NUMA nodes; loaded from a
  recorded file (`--topology FILE`) or built for a CPU-only host.
- `nvml`: discovery of the real host through NVML (nvidia-ml-py); CPU-only without a driver.
- `host`: the topology the server uses: `--topology FILE` or the discovered host.
- `policy`: instance requests -> concrete devices, CPU sets and worker environment.
- `instance_groups`: a version's instance groups -> the instances to start.
- `report`: the human-readable picture of a topology and where instances would go.

Nothing here imports paddle; NVML is imported only when `nvml.discover()` runs.
"""
