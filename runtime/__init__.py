"""The real executor: runs a commsim schedule through torch.distributed (needs torch).

Depends on ``commsim.ir``; ``commsim`` never imports this package.
"""
