"""Offline work: step-time profile building, SFS validation against real vLLM logs.

Run by the CLI (``switchyard profiles build``, ``switchyard validate-ttft``) and by
``bench/``; never on the routing path.
"""
