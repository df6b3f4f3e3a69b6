"""What a CPU's write-allocate caches make a memory-bound kernel move (pure).

A store to a line that is not in the cache first reads the line from memory (a read for
ownership), so a kernel that writes fresh memory moves its written bytes twice; one
that writes over what it just read (``x.mul_(c)``, an optimizer's in-place passes)
moves them once. A CPU profile's memory table (``HardwareProfile.elementwise_points``)
was timed with copies (``runtime.kernels``' ring ``copy_``): 3 bytes moved for every 2
the copy counts. An op that states its in-place writes (``Compute.in_place_bytes``) is
priced at the table's time for its counted bytes times moved / (1.5 x counted).

Measured on the development machine (``python bench/write_allocate.py``, 128 MB fp32
tensors, one thread each): one process, the copy 25.7 GB/s counted, out-of-place ``mul``
/ ``div`` / ``add`` 25.2 / 25.9 / 28.2 (this rule: 25.7 / 25.7 / 29.0), in-place ``add_``
/ ``addcdiv_`` / ``lerp_`` / ``mul_`` 38.7 / 38.0 / 41.9 / 45.7 (38.6); two processes at
once, the copy 14.0, in place 21.0-24.3 (21.1). ``sqrt`` into a fresh tensor ran at 15.0
(two: 8.8), its arithmetic slower than its memory: the rule does not price that.

Only a framework's run is priced this way: ``commsim execute`` runs every memory-bound
op as the table's copy, whose writes are all fresh. GPUs write whole sectors without
reading them first, so their profiles and the spec presets never apply it.
"""

from __future__ import annotations

from commsim.ir import ops as O

# bytes a calibration copy moves for each byte it counts (read, read for ownership, write
# of each 2 counted)
COPY_MOVED_PER_COUNTED = 1.5


def write_allocate_share(op: O.Compute) -> float:
    """``op``'s time as a share of the memory table's time for its counted bytes."""
    counted = op.bytes_read + op.bytes_written
    if not counted:
        return 1.0
    moved = counted + op.bytes_written - op.in_place_bytes  # fresh writes are read first
    return moved / (COPY_MOVED_PER_COUNTED * counted)
