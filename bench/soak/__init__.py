"""The soaks: long seeded runs through the ``Runtime`` (driver.py, its plan in plan.py) and over
HTTP (http_soak.py, which needs httpx, a test dependency). They live beside the benchmarks, out of
the wheel; ``make soak`` runs both (scripts/soak.py), tests/test_soak*.py run short ones."""
