"""Offline work: step-time profile building, SFS validation against real vLLM logs, the
default quality predictor (trained from vendored data on first use, cached).

Run by the CLI (``switchyard profiles build``, ``switchyard validate-ttft``, a router
started without ``--predictor``) and by ``bench/``; never on the routing path.
"""
