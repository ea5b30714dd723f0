# Stubs for tensorboardX 2.6.5 `tensorboardX/proto/tensor_pb2.py` (generated from
# TensorFlow's tensor.proto): only the fields that eqxctx.writers and its tests use.
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

class TensorProto:
    dtype: int
    string_val: Sequence[bytes]
    def __init__(
        self,
        *,
        dtype: int = ...,
        tensor_shape: Mapping[str, Any] | None = ...,
        string_val: Iterable[bytes] = ...,
    ) -> None: ...
