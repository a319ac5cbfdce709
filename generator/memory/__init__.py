"""Stage plan_memory: liveness over the lowered lines (liveness.py), the arena
plan (planner.py), and the memory report of `deepgen memory` (report.py)."""
