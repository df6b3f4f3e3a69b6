"""Example training scripts that run real frameworks on CPUs (gloo)."""
