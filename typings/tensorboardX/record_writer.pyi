# Stubs for tensorboardX 2.6.5 `tensorboardX/record_writer.py`: only what eqxctx's
# writers and tests use to checksum event-file records.
def masked_crc32c(data: bytes) -> int: ...

# The checksum `masked_crc32c` calls: `crc32c.crc32c` (C) when the crc32c package is
# installed, else `tensorboardX.crc32c._crc32c` (benchmarks swap it).
def crc32c(data: bytes) -> int: ...
