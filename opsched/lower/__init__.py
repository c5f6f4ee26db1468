"""Lower level: time-indexed schedule MIP, list scheduler, bounds, neighbourhood search."""
