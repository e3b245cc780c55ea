"""The converged study of docs/results.md: its data, phases and report, run from the checkout
(``python -m studies PHASE``; not installed with the package)."""
