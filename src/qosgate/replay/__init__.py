"""``qosgate replay``: a workload sent in real time to an OpenAI-compatible endpoint, measured
per class with the simulator's own metrics and report."""
