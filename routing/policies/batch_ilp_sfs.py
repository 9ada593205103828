"""Batch ILP + SFS (ours, the default policy): paper B's robust ILP with paper A's TTFT
check as constraints — stand-alone pruning, in-order SFS re-check, cuts, bounded rounds
(``routing.ilp.ttft_cuts``)."""

from __future__ import annotations

from routing.policies.batch_ilp import BatchIlpSfsRouter

__all__ = ["BatchIlpSfsRouter"]
