"""3. Profile: per-node forward/backward time and memory, measured or counted, cached; the
parameters' and the optimizer's costs."""
