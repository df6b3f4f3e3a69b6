"""The discrete-event simulator (SimPy) and its caching-allocator model."""
