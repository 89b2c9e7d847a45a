"""The repository-level tests (configs, manifests, preflight, bench, twin)."""
