"""The tests' name for :mod:`cdsgd.testing`'s process harness.

``from dist_harness import run_ranks, free_port`` keeps working in the
tests; the harness itself (spawn N gloo ranks on 127.0.0.1 with a hard
deadline) lives in ``cdsgd/testing.py``, shared with the benchmarks.
"""

from cdsgd.testing import RanksFailed, free_port, run_ranks

__all__ = ["RanksFailed", "free_port", "run_ranks"]
