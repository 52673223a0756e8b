"""Repo-wide pytest setup: Hypothesis settings profiles.

Kept at the repository root so tests/ and property_tests/ share one registration,
and so it is loaded before pytest's `--hypothesis-profile` option is applied.

Pick a profile with `--hypothesis-profile=NAME` (what `make test` does) or the
HYPOTHESIS_PROFILE environment variable.
"""

import os

from hypothesis import HealthCheck, settings

# The event-loop checks (slow callbacks, blocking calls on the loop thread) for every test.
pytest_plugins = ["tests.loop_checks"]

# CI: few examples, derandomized so every run explores the same cases; a failure
# prints a blob that reproduces it locally via @reproduce_failure.
settings.register_profile(
    "ci",
    max_examples=25,
    stateful_step_count=30,
    deadline=None,  # shared CI runners make per-example timing noise, not signal
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "nightly",
    max_examples=1000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# Hypothesis itself loads its `ci` profile when $CI is set; keep that behaviour
# instead of overriding it with `dev`.
default_profile = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default_profile))


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """Tests that ran MLX on the main thread must clear its streams before the interpreter exits
    (MLX requires it; without it the process can abort at exit and turn a pass into a failure)."""
    from runtime.kernel.actor import release_thread_resources

    release_thread_resources()
