"""The planner: what a training layout costs in memory and time, on paper."""
