import os
import warnings


#: `EQXCTX_TEST_PLATFORM=tpu` (or `gpu`) runs the suite on that platform: JAX's
#: platform is left alone (no `JAX_PLATFORMS=cpu`), tests that need more devices
#: than it has skip, and tests marked `cpu_only` (pinned CPU digits, XLA:CPU
#: instruction counts) skip with their reason. Unset (CI): 8 simulated CPU devices.
PLATFORM = os.environ.get("EQXCTX_TEST_PLATFORM", "cpu")

if PLATFORM == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Simulated CPU devices for the sharding tests; before JAX starts a backend.
    os.environ.setdefault("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

# JAX's start-up warnings on an accelerator host (transparent hugepages, a TPU's
# other chips) are not errors: import JAX and start its backend with them ignored.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import jax  # (after the device flags)

    if PLATFORM != "cpu":
        jax.devices()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip `cpu_only` tests on another platform, with the marker's reason."""
    if PLATFORM == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.kwargs.get("reason") or (marker.args or ["CPU only"])[0]
            item.add_marker(pytest.mark.skip(reason=f"{PLATFORM}: {reason}"))


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
