"""Summary writers: JSON lines (no extra dependency) and TensorBoard (tensorboardX).

Both take the summaries of an `OutputCollection` (or a nested mapping of them) once per
step and write each leaf's `Summary.value()` under its "/"-joined path:

```python
with (
    JsonlWriter("runs/exp/summaries.jsonl") as jsonl,
    TensorBoardWriter("runs/exp") as tb,
):
    for step in range(num_steps):
        state, collection = train_step(state, batch)
        jsonl.write(step, collection)
        tb.write(step, collection)
```
"""

from ._base import AbstractWriter as AbstractWriter
from ._jsonl import JsonlWriter as JsonlWriter
from ._tensorboard import TensorBoardWriter as TensorBoardWriter
