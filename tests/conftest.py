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


# The inner loop stays within its 2 minutes only while the tests it runs stay quick: at the end of
# a run, name each test not marked slow whose call took over FAST_LIMIT_S, so that it gets
# @pytest.mark.slow. Twice the ~1.5 s the marks were set by, since a busy machine doubles times:
# a prompt, not a failure.
FAST_LIMIT_S = 3.0
_over_limit = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > FAST_LIMIT_S and "slow" not in report.keywords:
        _over_limit.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over_limit:
        terminalreporter.section(f"tests not marked slow that took over {FAST_LIMIT_S:g} s")
        for seconds, nodeid in sorted(_over_limit, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
        terminalreporter.write_line("mark them @pytest.mark.slow, so that -m 'not slow' stays the inner loop")
