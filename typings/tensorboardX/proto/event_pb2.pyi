# Stubs for tensorboardX 2.6.5 `tensorboardX/proto/event_pb2.py` (generated from
# TensorFlow's event.proto): only the fields that eqxctx.writers and its tests use.
from tensorboardX.proto.summary_pb2 import Summary

class Event:
    wall_time: float
    step: int
    file_version: str
    summary: Summary
    def __init__(
        self,
        *,
        wall_time: float = ...,
        step: int = ...,
        file_version: str = ...,
        summary: Summary | None = ...,
    ) -> None: ...
    def HasField(self, field_name: str) -> bool: ...
    def SerializeToString(self) -> bytes: ...
    @staticmethod
    def FromString(data: bytes) -> Event: ...
