"""Results: metrics of a step, traces from simulations, plots."""
