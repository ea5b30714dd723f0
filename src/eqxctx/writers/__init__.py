"""Summary writers: JSON lines (no extra dependency), TensorBoard and W&B (extras).

Each takes the summaries of an `OutputCollection` (or a nested mapping of them) once
per step and writes each leaf's `Summary.value()` under its "/"-joined path. Wrap them
in `AsyncWriter` so that the training loop never waits for the disk, and in
`MultiWriter` to write to several at once:

```python
writer = AsyncWriter(
    MultiWriter(JsonlWriter("runs/exp/summaries.jsonl"), TensorBoardWriter("runs/exp"))
)
with writer:
    for step in range(num_steps):
        state, collection = train_step(state, batch)
        writer.write(step, collection)
```

In a multi-process run, every process creates the writers and calls `write` with the
same summaries (fetching is a collective); only process 0 writes files.
"""

from eqxctx._records import Audio as Audio, Histogram as Histogram, Image as Image

from ._async import AsyncWriter as AsyncWriter
from ._base import AbstractWriter as AbstractWriter, HostSummaries as HostSummaries
from ._buffer import SummaryBuffer as SummaryBuffer
from ._host import HostValue as HostValue
from ._jsonl import JsonlWriter as JsonlWriter
from ._multi import MultiWriter as MultiWriter
from ._read import fetch_summaries as fetch_summaries
from ._tensorboard import TensorBoardWriter as TensorBoardWriter
from ._wandb import WandbWriter as WandbWriter
