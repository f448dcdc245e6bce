"""The simulator: the gateway's scheduling core and simulated engine model, driven in virtual
time by a workload (``qosgate simulate``; see docs/guides/simulator.md)."""
