import os


# Simulated CPU devices for the sharding tests; must be set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax
from hypothesis import HealthCheck, settings


# Must run before any array exists.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    settings.get_profile("dev"),
    max_examples=15,
    derandomize=True,
    database=None,
    print_blob=True,
)
# A longer search, for runs by hand: `pytest --hypothesis-profile=thorough`.
settings.register_profile("thorough", settings.get_profile("dev"), max_examples=500)
settings.load_profile("dev")
