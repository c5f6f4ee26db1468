"""Upper level: blocks to device groups and parallel modes (MIP)."""
