"""Engine compute models, pure: the step contract, the simulated GPU and llama.cpp's steps.
They advance when stepped and read no clock; the asyncio runner (``runtime.inprocess``) and the
simulator drive them."""
