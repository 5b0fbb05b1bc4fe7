"""10. Schedules: which work each stage does for which micro-batch, in which order, as data.

Below the planner and the runtime, and free of torch: the actions, the generators, the schedule
kinds, the CSV format, the lowering to a rank's program (recomputation, messages, once-a-step
work), the simulator that checks and times it, and the points where sends are released."""
