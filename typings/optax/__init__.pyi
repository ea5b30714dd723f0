# Stubs for optax 0.2.8 (https://github.com/google-deepmind/optax): only the names that
# eqxctx.demo uses.
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

from jax.typing import ArrayLike

OptState: TypeAlias = Any
Params: TypeAlias = Any
Updates: TypeAlias = Any
Schedule: TypeAlias = Callable[[ArrayLike], ArrayLike]
ScalarOrSchedule: TypeAlias = float | ArrayLike | Schedule

class GradientTransformation(NamedTuple):
    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]

def adam(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-8,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation: ...
def cosine_decay_schedule(
    init_value: ArrayLike,
    decay_steps: int,
    alpha: ArrayLike = 0.0,
    exponent: ArrayLike = 1.0,
) -> Schedule: ...
