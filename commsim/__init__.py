"""commsim: predict and measure communication/compute overlap of sharded data parallelism.

Import-light by design: needs only the standard library, simpy, pandas and matplotlib,
never torch (the real executor lives in the separate ``runtime`` package).
"""

__version__ = "0.1.0"
