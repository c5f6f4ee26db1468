"""Lower level: time-indexed schedule MIP, list scheduler, bounds, neighbourhood search.

>>> from opsched.schedule import chain_stage_graph
>>> result = solve(chain_stage_graph(2, f=1, b=2, w=1), 4, time_limit=5)
>>> str(result.status), result.gap
('optimal', 0.0)
"""

from opsched.lower.jobs import minimum_memory_limit
from opsched.lower.solve import LowerOptions, LowerResult, solve

__all__ = ["LowerOptions", "LowerResult", "minimum_memory_limit", "solve"]
