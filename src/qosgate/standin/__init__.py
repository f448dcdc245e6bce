"""The vLLM stand-in: an OpenAI-compatible server over the simulated GPU engine, with faults to
inject; a test double run as its own process (``python -m qosgate.standin``)."""
