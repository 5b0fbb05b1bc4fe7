"""8. Split: one fx.GraphModule per stage from the plan's node-to-stage assignment; each stage's
interface; the other mode's graph on the same stages."""
