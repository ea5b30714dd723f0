# Stubs for tensorboardX 2.6.5 (https://github.com/lanpa/tensorboardX): only the names
# that eqxctx.writers and its tests use.
from typing import Any

import numpy as np

class FileWriter:
    def add_summary(
        self,
        summary: Any,
        global_step: int | None = None,
        walltime: float | None = None,
    ) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...

class SummaryWriter:
    file_writer: FileWriter
    def __init__(
        self,
        logdir: str | None = None,
        comment: str | None = "",
        purge_step: int | None = None,
        max_queue: int | None = 10,
        flush_secs: int | None = 120,
        filename_suffix: str | None = "",
        write_to_disk: bool | None = True,
        log_dir: str | None = None,
        **kwargs: Any,
    ) -> None: ...
    def add_scalar(
        self,
        tag: str,
        scalar_value: float | np.ndarray,
        global_step: int | None = None,
        walltime: float | None = None,
        display_name: str | None = "",
        summary_description: str | None = "",
    ) -> None: ...
    def add_histogram(
        self,
        tag: str,
        values: np.ndarray,
        global_step: int | None = None,
        bins: str | None = "tensorflow",
        walltime: float | None = None,
        max_bins: int | None = None,
    ) -> None: ...
    def add_images(
        self,
        tag: str,
        img_tensor: np.ndarray,
        global_step: int | None = None,
        walltime: float | None = None,
        dataformats: str | None = "NCHW",
    ) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
