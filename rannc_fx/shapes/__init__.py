"""2. Shapes: every value's per-sample shape, batch dimension and integer formula (fake tensors);
the dimensions a call may change; the tail where samples mix."""
