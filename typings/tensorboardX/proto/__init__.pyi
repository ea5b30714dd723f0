# Stubs for tensorboardX 2.6.5: the generated protobuf modules that eqxctx uses.
