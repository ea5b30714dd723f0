# Stubs for tensorboardX 2.6.5 `tensorboardX/proto/event_pb2.py` (generated from
# TensorFlow's event.proto): only the fields that eqxctx's tests read.
from tensorboardX.proto.summary_pb2 import Summary

class Event:
    wall_time: float
    step: int
    file_version: str
    summary: Summary
    def HasField(self, field_name: str) -> bool: ...
    @staticmethod
    def FromString(data: bytes) -> Event: ...
