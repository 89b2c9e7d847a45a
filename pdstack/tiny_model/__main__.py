"""python -m pdstack.tiny_model [--cache-dir DIR] [--mtp]: generate (or find)
the pair and print its two paths last; with --mtp the tiny-mtp target too."""

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
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="also the tiny-mtp profile's target (its MTP layer inside)",
    )
    args = parser.parse_args(argv)
    models = tiny_model.ensure_models(
        args.cache_dir, progress=lambda m: print(m, file=sys.stderr)
    )
    print(f"target={models.target}")
    print(f"draft={models.draft}")
    if args.mtp:
        from pdstack.tiny_model.mtp_cache import ensure_mtp_model

        mtp = ensure_mtp_model(
            args.cache_dir, progress=lambda m: print(m, file=sys.stderr)
        )
        print(f"mtp_target={mtp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
