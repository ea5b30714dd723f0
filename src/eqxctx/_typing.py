"""Shared type aliases and TypeVars."""

from typing import Any, TypeAlias, TypeVar

import numpy as np
from jaxtyping import Array, Key, UInt32


Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")
R = TypeVar("R")

#: A PRNG key: a raw `uint32[2]` key (`jax.random.PRNGKey`) or a typed key
#: (`jax.random.key`).
PRNGKey: TypeAlias = Key[Array, ""] | UInt32[Array, "2"] | UInt32[np.ndarray, "2"]

#: A nested mapping of names to leaves or nested mappings.
Nested: TypeAlias = dict[str, Any]

#: A path predicate: `drop(path) -> bool` with "/"-joined paths.
PathPredicate: TypeAlias = Any

ArrayLikeLeaf: TypeAlias = Array | np.ndarray | np.generic | bool | int | float
