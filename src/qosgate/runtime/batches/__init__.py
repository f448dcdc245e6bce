"""Batch jobs (the OpenAI Batch API): their durable store, uploads, and the feeder that runs
their lines through the scheduler on spare capacity."""
