# Stubs for scikit-learn 1.9.1 `sklearn.datasets`: only `load_digits` with
# `return_X_y=True`, as eqxctx.demo calls it.
from typing import Any, Literal

import numpy as np

def load_digits(
    *, n_class: int = 10, return_X_y: Literal[True], as_frame: Literal[False] = False
) -> tuple[
    np.ndarray[Any, np.dtype[np.float64]], np.ndarray[Any, np.dtype[np.int64]]
]: ...
