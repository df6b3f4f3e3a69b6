"""Example training scripts that run real frameworks on this machine (CPU, gloo)."""
