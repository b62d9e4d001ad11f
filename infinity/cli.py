"""The `infinity` command moved to infinity.tools.cli; this keeps `python -m infinity.cli` and console scripts
made by an install older than that move working."""

from infinity.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
