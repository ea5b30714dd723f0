# Stubs for tensorboardX 2.6.5 (https://github.com/lanpa/tensorboardX). eqxctx uses
# only its protobuf modules and `record_writer.masked_crc32c` (see the submodules).
