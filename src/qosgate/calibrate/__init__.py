"""``qosgate calibrate URL``: a short probe of an OpenAI-compatible engine that fits the
simulator's step model (``models/simmodel.py``) and writes it as an engine profile.

``engine`` sends the probe's requests, ``probe`` plans and runs the measurements, ``fit`` is the
least squares (pure), ``report`` prints the error and writes the YAML, ``cli`` is the command.
"""
