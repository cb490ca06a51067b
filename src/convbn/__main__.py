"""``python -m convbn COMMAND ...``: see :mod:`convbn.cli`."""
from convbn.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
