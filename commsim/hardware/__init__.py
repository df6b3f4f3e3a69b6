"""Hardware: GPU / node / fabric presets with sources, cost functions, measured profiles."""
