"""Batch jobs (the OpenAI Batch API): their durable store, uploads, and the feeder that runs
their lines through the scheduler on spare capacity.

Words: everything of the Batch API is named *batches* in code (``runtime.batches``,
``server.batches``, ``wire.batches``, ``core.batches_feed``, ``sim.batches``); one Batch API
object may be called a *batch job* (or *job*) in prose. A plain *batch* is the engine's own: the
sequences it runs in one step. An *engine request* (``wire.engine_request``) is one engine call.
"""
