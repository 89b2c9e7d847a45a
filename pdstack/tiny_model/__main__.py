"""python -m pdstack.tiny_model [--cache-dir DIR]: generate (or find) the pair
and print its two paths last."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdstack import tiny_model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(tiny_model.__doc__ or "").splitlines()[0]
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="default: $PD_MODEL_CACHE or ~/.cache/pd-mooncake/models",
    )
    args = parser.parse_args(argv)
    models = tiny_model.ensure_models(
        args.cache_dir, progress=lambda m: print(m, file=sys.stderr)
    )
    print(f"target={models.target}")
    print(f"draft={models.draft}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
