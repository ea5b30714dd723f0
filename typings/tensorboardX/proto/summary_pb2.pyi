# Stubs for tensorboardX 2.6.5 `tensorboardX/proto/summary_pb2.py` (generated from
# TensorFlow's summary.proto): only the fields that eqxctx.writers and its tests use.
from collections.abc import Iterable, Sequence

from tensorboardX.proto.tensor_pb2 import TensorProto

class HistogramProto:
    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limit: Sequence[float]
    bucket: Sequence[float]
    def __init__(
        self,
        *,
        min: float = ...,
        max: float = ...,
        num: float = ...,
        sum: float = ...,
        sum_squares: float = ...,
        bucket_limit: Iterable[float] = ...,
        bucket: Iterable[float] = ...,
    ) -> None: ...

class SummaryMetadata:
    class PluginData:
        plugin_name: str
        content: bytes
        def __init__(self, *, plugin_name: str = ..., content: bytes = ...) -> None: ...

    plugin_data: SummaryMetadata.PluginData
    def __init__(
        self, *, plugin_data: SummaryMetadata.PluginData | None = ...
    ) -> None: ...

class Summary:
    class Image:
        height: int
        width: int
        colorspace: int
        encoded_image_string: bytes

    class Audio:
        sample_rate: float
        num_channels: int
        length_frames: int
        encoded_audio_string: bytes
        content_type: str
        def __init__(
            self,
            *,
            sample_rate: float = ...,
            num_channels: int = ...,
            length_frames: int = ...,
            encoded_audio_string: bytes = ...,
            content_type: str = ...,
        ) -> None: ...

    class Value:
        tag: str
        simple_value: float
        image: Summary.Image
        audio: Summary.Audio
        histo: HistogramProto
        metadata: SummaryMetadata
        tensor: TensorProto
        def __init__(
            self,
            *,
            tag: str = ...,
            simple_value: float = ...,
            audio: Summary.Audio | None = ...,
            histo: HistogramProto | None = ...,
            metadata: SummaryMetadata | None = ...,
            tensor: TensorProto | None = ...,
        ) -> None: ...
        def HasField(self, field_name: str) -> bool: ...
        def WhichOneof(self, oneof_group: str) -> str | None: ...

    value: Sequence[Summary.Value]
    def __init__(self, *, value: Iterable[Summary.Value] = ...) -> None: ...
    def CopyFrom(self, other_msg: Summary) -> None: ...
