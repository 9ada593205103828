"""Batch jobs: a JSON Lines file of requests (OpenAI Batch API lines or query bodies) run
through the service under a job-wide budget, resumable, with OpenAI's output, error and
status files (``batch.files``: the files; ``batch.job``: the engine). ``switchyard batch``
is the command line over it.
"""
