"""Read TensorBoard event files back (TFRecord framing + tensorboardX's protos)."""

import os
import struct

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c


def read_events(logdir: str) -> list[Event]:
    """Return every event of every `events.out.tfevents.*` file, checking the CRCs."""
    events: list[Event] = []
    names = sorted(n for n in os.listdir(logdir) if n.startswith("events.out.tfevents"))
    assert names, f"no event file in {logdir}: {os.listdir(logdir)}"
    for name in names:
        with open(os.path.join(logdir, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
            assert header_crc == masked_crc32c(header)
            record = data[pos + 12 : pos + 12 + length]
            (record_crc,) = struct.unpack(
                "<I", data[pos + 12 + length : pos + 16 + length]
            )
            assert record_crc == masked_crc32c(record)
            events.append(Event.FromString(record))
            pos += 16 + length
    return events


def summary_values(logdir: str) -> list[tuple[int, Summary.Value]]:
    """Return `(step, value)` for every summary value in the event files."""
    return [
        (event.step, value)
        for event in read_events(logdir)
        if event.HasField("summary")
        for value in event.summary.value
    ]


def scalars(logdir: str) -> dict[tuple[int, str], float]:
    """Return `{(step, tag): simple_value}` of the scalar summaries."""
    return {
        (step, value.tag): value.simple_value
        for step, value in summary_values(logdir)
        if value.WhichOneof("value") == "simple_value"
    }
