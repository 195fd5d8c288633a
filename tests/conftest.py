"""Tests run on 8 forced CPU devices; this must happen before jax initialises.

The tiers (markers registered in pyproject.toml): ``pytest -m "not slow"`` is the inner
loop; the CI runs everything. A test marked multiprocess, ray, browser or fuzz is also
marked slow here, so that each such test need not carry both marks."""
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

# Starting interpreters, a Ray cluster or chromium, or running the fuzzer's programs, takes
# seconds: these marks imply slow.
ALWAYS_SLOW = ("multiprocess", "ray", "browser", "fuzz")


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true", default=False,
                     help="rewrite the golden IR dumps under tests/golden/ instead of comparing with them")


@pytest.hookimpl(tryfirst=True)   # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and any(item.get_closest_marker(m) for m in ALWAYS_SLOW):
            item.add_marker(pytest.mark.slow)
